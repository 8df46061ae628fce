"""Curriculum from history: `generate.prompt_filter` skips prompts by their past pass rate.

Iteration K (each of its top-up rounds too) takes its batch of the prompt order as always, then
skips every prompt of the batch whose history fails the filter. The history is `prompt_stats`
(sql/prompt_stats.sql) over the committed scores of iterations 0 .. K-1-S (S = max_staleness;
every round of each), the iterations whose training made the policy iteration K samples from
(the last W of them with `generate.prompt_filter_window = W`, so an iteration reads W scores
folders however long the run):

    attempts    rollouts with a score (null or NaN: not an attempt)
    mean_score  their mean score
    pass_rate   the share of them with score > generate.pass_threshold (default 0.5)
    last_iter   the last iteration that sampled the prompt

`prompt_filter = [lo, hi]` keeps the prompts with lo <= pass_rate <= hi; a string is an SQL
predicate over those columns (`attempts < 4 OR pass_rate BETWEEN 0.1 AND 0.9`). A prompt
without history (never sampled, or no scored rollout) is always kept. The decision reads only
complete folders of earlier iterations, so a resumed or re-run iteration skips the same
prompts; a missing scores folder of the history is an error. The rollouts manifest records the
skipped prompt ids and the history's iterations (`prompt_filter`), `prompt_counts` counts them
(`prompts_skipped_filter`), and generate's inputs hold the filter and the history's manifests.
A batch whose every prompt is skipped is an error (widen the filter).

Refill (`generate.prompt_filter_refill = R` > 0, with prompts_per_iteration > 0), as DAPO's
dynamic sampling keeps drawing from its data loader: the prompts the filter skipped are replaced
by kept prompts of the next batches of the order, up to R of them, taken in order; of a weighted
mixture each source is refilled to its quota from its own prompts (a source whose prompts all
fail stays short). A prompt already in the batch is not taken twice. Every batch a refill reads
counts as taken: the next round (top-up or iteration) starts after it (topup.py). The manifest
records the batches read and the prompts added (`prompt_filter.refill`, `prompt_batch.refill`,
`prompt_counts.prompts_refilled`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from rlhf_batch.config import Config
from rlhf_batch.data.mixtures import SOURCE
from rlhf_batch.data.prompts import Prompts
from rlhf_batch.errors import StageError
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import SCORES


def enabled(cfg: Config) -> bool:
    return cfg.generate.prompt_filter != ""


def predicate(cfg: Config) -> str:
    """The filter as an SQL predicate over prompt_stats (a band is `pass_rate BETWEEN lo AND hi`)."""
    f = cfg.generate.prompt_filter
    if isinstance(f, list):
        return f"pass_rate BETWEEN {float(f[0])!r} AND {float(f[1])!r}"
    return f


def history(cfg: Config, iteration: int) -> list[int]:
    """The iterations whose scores decide iteration `iteration`'s filter: 0 .. K-1-max_staleness,
    the last generate.prompt_filter_window of them when that is > 0."""
    end = max(0, iteration - cfg.max_staleness)
    window = cfg.generate.prompt_filter_window
    return list(range(max(0, end - window) if window else 0, end))


def score_folders(cfg: Config, iteration: int) -> list[tuple[int, Any]]:
    """(iteration, scores folder) of the history, every complete top-up round included; a missing
    round-0 scores folder is an error naming it."""
    from rlhf_batch.data.topup import rounds_taken

    out = []
    for it in history(cfg, iteration):
        sdir = layout.folder(cfg.run_dir, it, layout.SCORES)
        if manifests.manifest(sdir) is None:
            raise StageError(
                f"{sdir}: not complete; generate.prompt_filter decides iteration {iteration}'s prompts "
                f"from the scores of iterations 0..{iteration - 1 - cfg.max_staleness}"
            )
        out.append((it, sdir))
        for r in range(1, rounds_taken(cfg.run_dir, it) + 1):
            topped = layout.folder(cfg.run_dir, it, layout.SCORES, r)
            if manifests.manifest(topped) is not None:
                out.append((it, topped))
    return out


def inputs(cfg: Config, iteration: int) -> dict[str, Any]:
    """What generate's identity records of the filter: its predicate, the threshold and the
    fingerprint of the history's scores manifests (their parts and commit times)."""
    folders = score_folders(cfg, iteration)
    recorded = [
        [str(layout.in_run(str(sdir), cfg.run_dir)), m["parts"], m.get("created")]
        for _, sdir in folders
        if (m := manifests.manifest(sdir)) is not None
    ]
    return {
        "predicate": predicate(cfg),
        "pass_threshold": cfg.generate.pass_threshold,
        "history": manifests.fingerprint(recorded),
        **({"refill": cfg.generate.prompt_filter_refill} if cfg.generate.prompt_filter_refill else {}),
        **({"window": cfg.generate.prompt_filter_window} if cfg.generate.prompt_filter_window else {}),
    }


def stats(cfg: Config, iteration: int) -> pa.Table:
    """prompt_stats over the history of iteration `iteration` (sql/prompt_stats.sql)."""
    import duckdb

    from rlhf_batch.sql import NAN_SAFE

    tables = []
    for it, sdir in score_folders(cfg, iteration):
        t = manifests.read_complete(sdir, SCORES, ["prompt_id", "score"])
        tables.append(t.append_column("iter", pa.array([it] * t.num_rows, pa.int32())))
    empty = {"prompt_id": pa.array([], pa.string()), "score": pa.array([], pa.float64())}
    scores = pa.concat_tables(tables) if tables else pa.table({**empty, "iter": pa.array([], pa.int32())})
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_external_access = false")
        con.execute(NAN_SAFE)
        con.register("scores", scores)
        query = stats_query(cfg.generate.pass_threshold)
        return con.sql(f"SELECT * FROM ({query}) ORDER BY prompt_id").to_arrow_reader().read_all()
    finally:
        con.close()


def stats_query(threshold: float) -> str:
    from rlhf_batch.sql import sql_text

    return sql_text("prompt_stats").replace("{threshold}", repr(float(threshold)))


def skipped(cfg: Config, iteration: int, ids: list[str]) -> list[str]:
    """The prompt ids of `ids` (in their order) whose history fails the filter."""
    import duckdb

    table = stats(cfg, iteration)
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_external_access = false")
        con.register("prompt_stats", table)
        try:
            rows = con.execute(
                f"SELECT prompt_id FROM prompt_stats WHERE NOT coalesce(({predicate(cfg)}), false)"
            )
        except duckdb.Error as e:
            line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
            raise StageError(f"generate.prompt_filter: {line}") from None
        failing = {r[0] for r in rows.fetchall()}
    finally:
        con.close()
    return [i for i in ids if i in failing]


def apply(
    cfg: Config, iteration: int, prompts: Prompts, batch: Callable[[int], Prompts] | None = None
) -> tuple[Prompts, dict[str, Any]]:
    """The prompts the filter keeps, and what the manifest records (`prompt_filter`); with
    `generate.prompt_filter_refill`, refilled from the batches `batch(k)` loads (see the module)."""
    skip = set(skipped(cfg, iteration, prompts.ids))
    keep = [i for i, pid in enumerate(prompts.ids) if pid not in skip]
    kept = _take(prompts, keep)
    refill: dict[str, Any] = {}
    if cfg.generate.prompt_filter_refill and batch is not None:
        kept, refill = _refill(cfg, iteration, prompts, kept, batch)
    if not kept.ids:
        raise StageError(
            f"generate.prompt_filter skips every prompt of iteration {iteration}'s batch "
            f"({len(prompts.ids)} prompts); widen it"
        )
    kept.counts = {**prompts.counts, "prompts": len(kept.ids), "prompts_skipped_filter": len(skip)}
    if refill:
        kept.counts["prompts_refilled"] = len(refill["prompts"])
    h = history(cfg, iteration)
    record = {
        "predicate": predicate(cfg),
        "pass_threshold": cfg.generate.pass_threshold,
        "history": [h[0], h[-1]] if h else [],
        "skipped": [pid for pid in prompts.ids if pid in skip],
        **({"refill": refill} if refill else {}),
    }
    return kept, record


def _take(p: Prompts, rows: list[int]) -> Prompts:
    return Prompts(
        [p.ids[i] for i in rows],
        [p.texts[i] for i in rows],
        [p.tokens[i] for i in rows],
        p.carried.take(pa.array(rows, pa.int64())),
        dict(p.counts),
        dict(p.batch),
    )


def _sources(p: Prompts) -> list[Any]:
    """Each prompt's mixture source (None for every prompt of a single prompt set)."""
    if SOURCE in p.carried.column_names:
        return p.carried.column(SOURCE).to_pylist()
    return [None] * len(p.ids)


def _refill(
    cfg: Config, iteration: int, full: Prompts, kept: Prompts, batch: Callable[[int], Prompts]
) -> tuple[Prompts, dict[str, Any]]:
    """`kept` refilled to the batch's size (each source to its count in `full`) from the kept
    prompts of the next batches, in order; and what the manifest records of it."""
    want = Counter(_sources(full))
    want.subtract(Counter(_sources(kept)))
    have = set(kept.ids)
    start = int(full.batch["batch"])
    read: list[int] = []
    added: list[Prompts] = []
    for k in range(start + 1, start + 1 + cfg.generate.prompt_filter_refill):
        if not any(n > 0 for n in want.values()):
            break
        nxt = batch(k)
        read.append(k)
        skip = set(skipped(cfg, iteration, nxt.ids))
        rows = []
        for i, (pid, src) in enumerate(zip(nxt.ids, _sources(nxt), strict=True)):
            if pid not in skip and pid not in have and want[src] > 0:
                rows.append(i)
                have.add(pid)
                want[src] -= 1
        added.append(_take(nxt, rows))
    if not read:
        return kept, {}
    parts = [kept, *added]
    out = Prompts(
        [i for p in parts for i in p.ids],
        [t for p in parts for t in p.texts],
        [t for p in parts for t in p.tokens],
        pa.concat_tables([p.carried for p in parts], promote_options="permissive"),
        kept.counts,
        {**kept.batch, "refill": read},
    )
    return out, {"batches": read, "prompts": [i for p in added for i in p.ids]}
