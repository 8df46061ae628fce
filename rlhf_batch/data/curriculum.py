"""Curriculum from history: `generate.prompt_filter` skips prompts by their past pass rate.

Iteration K (each of its top-up rounds too) takes its batch of the prompt order as always, then
skips every prompt of the batch whose history fails the filter. The history is `prompt_stats`
(sql/prompt_stats.sql) over the committed scores of iterations 0 .. K-1-S (S = max_staleness;
every round of each), the iterations whose training made the policy iteration K samples from:

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
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from rlhf_batch.config import Config
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
    """The iterations whose scores decide iteration `iteration`'s filter: 0 .. K-1-max_staleness."""
    return list(range(max(0, iteration - cfg.max_staleness)))


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


def apply(cfg: Config, iteration: int, prompts: Prompts) -> tuple[Prompts, dict[str, Any]]:
    """The prompts the filter keeps, and what the manifest records (`prompt_filter`)."""
    skip = set(skipped(cfg, iteration, prompts.ids))
    keep = [i for i, pid in enumerate(prompts.ids) if pid not in skip]
    if not keep:
        raise StageError(
            f"generate.prompt_filter skips every prompt of iteration {iteration}'s batch "
            f"({len(prompts.ids)} prompts); widen it"
        )
    counts = {**prompts.counts, "prompts": len(keep), "prompts_skipped_filter": len(skip)}
    kept = Prompts(
        [prompts.ids[i] for i in keep],
        [prompts.texts[i] for i in keep],
        [prompts.tokens[i] for i in keep],
        prompts.carried.take(pa.array(keep, pa.int64())),
        counts,
        prompts.batch,
    )
    h = history(cfg, iteration)
    record = {
        "predicate": predicate(cfg),
        "pass_threshold": cfg.generate.pass_threshold,
        "history": [h[0], h[-1]] if h else [],
        "skipped": [pid for pid in prompts.ids if pid in skip],
    }
    return kept, record
