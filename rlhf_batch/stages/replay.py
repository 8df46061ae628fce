"""Replay of stored training rows: `advantage.replay = {iterations = W, where = "...", max_share = f}`.

Iteration K's advantages get, after its own training rows, rows of the advantages of
iterations K-W .. K-1 (those >= 0; each must be complete): the rows of each source iteration's
own rollouts (not rows it replayed itself) whose scored rollout (its rollouts columns, the
prompt set's carried columns and its scores columns: `score`, `reward`, `kl_sum`, ... joined on
rollout_id, top-up rounds included) satisfies the SQL predicate `where` (default: every row).

How many: with n own rows, at most floor(f n / (1 - f)) replayed rows, so they are at most a
share f of the rows train reads (f taken as the decimal written: 0.2 is 1/5). When more rows
qualify, a seeded choice (numpy, seeded by (seed, K)) over the candidates sorted by (source
iteration, rollout_id) picks which; the picked rows are written in a seeded hash order (md5 of
'{seed}:{K}:replay:{rollout_id}') into parts after the own ones, rows_per_part each. The choice
depends only on complete folders of earlier iterations and on n, so a resumed or re-run
advantage writes the same parts; the inputs hold the source folders' manifests, so a changed
source refuses the folder.

What a replayed row carries: the row as stored (`advantages` columns of its iteration). Its
`advantage` is the one computed within its original group at its own iteration, against that
group's mean and std (recomputing it against today's groups would mix rewards of different
policies in one baseline, and the group is gone from iteration K); its `behavior_logprobs` are
those of the policy that sampled it, so train's decoupled objective treats it as any stale
rollout: the proximal log-probs are recomputed with iteration K's start policy, and `tis_cap`
caps the importance weight proximal / behaviour (replay turns `train.recompute_old` on and sets
the stale `tis_cap` default, as `max_staleness` > 0 does). Its staleness, the policy updates
between its sampling policy and train K's start policy, is (K - j) + the source iteration's own
staleness; the manifest's `replay` records, per source iteration j, that staleness, the rows
and their rollout ids, plus the candidates and the cap; `counts.rows_replayed` counts them.

A multi-turn row keeps its `loss_mask` (the replay parts have the column when a source's rows
have it; a single-turn source's rows hold null there: all ones). With `advantage.estimator =
"opd"` a row keeps its stored `token_advantages`: teacher - behaviour log-probs of the policy
that sampled it (- that iteration's baseline + opd_task_weight x its group advantage). The
teacher is fixed, so its log-probs still hold; the per-token signal is the one a stale rollout
carries (behaviour, not the current policy: advantage has no model to recompute it), and the
decoupled objective corrects for the sampling policy as above. A source iteration written
with another estimator has no per-token advantages to replay: opd refuses it in one line
(`_check_token_advantages`), before anything is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa

from rlhf_batch.config import Config
from rlhf_batch.core.staleness import staleness
from rlhf_batch.errors import StageError
from rlhf_batch.store import fs, layout, manifests


@dataclass
class Replayed:
    """The rows chosen: rollout ids per source iteration, the candidates and the cap."""

    ids: dict[int, list[str]] = field(default_factory=dict)
    candidates: int = 0
    cap: int = 0

    @property
    def rows(self) -> int:
        return sum(len(v) for v in self.ids.values())


def enabled(cfg: Config) -> bool:
    return bool(cfg.advantage.replay)


def sources(cfg: Config, iteration: int) -> list[int]:
    """Iterations K-W .. K-1 (>= 0); each one's advantages, rollouts and scores must be complete."""
    out = list(range(max(0, iteration - int(cfg.advantage.replay["iterations"])), iteration))
    for j in out:
        for folder in (layout.ADVANTAGES, layout.ROLLOUTS, layout.SCORES):
            sdir = layout.folder(cfg.run_dir, j, folder)
            if manifests.manifest(sdir) is None:
                raise StageError(
                    f"{sdir}: not complete; advantage.replay of iteration {iteration} reads iterations "
                    f"{out[0]}..{out[-1]}"
                )
    return out


def inputs(cfg: Config, iteration: int) -> dict[str, Any]:
    r = cfg.advantage.replay
    return {
        "iterations": r["iterations"],
        "where": r.get("where", "true"),
        "max_share": r["max_share"],
        "sources": {
            f"iter={j:04d}/advantages": manifests.file_fingerprint(
                layout.folder(cfg.run_dir, j, layout.ADVANTAGES) / layout.MANIFEST
            )
            for j in sources(cfg, iteration)
        },
    }


def cap(own_rows: int, max_share: float) -> int:
    """The most replayed rows with `own_rows` own rows: floor(f n / (1 - f)), f as written."""
    f = Fraction(str(max_share))
    return math.floor(f * own_rows / (1 - f))


def _files(cfg: Config, j: int, folder: str) -> list[str]:
    """The committed parts of iteration j's `folder`, its top-up rounds' too (rollouts, scores)."""
    from rlhf_batch.data.topup import rounds_taken

    rounds = [0] if folder == layout.ADVANTAGES else [0, *range(1, rounds_taken(cfg.run_dir, j) + 1)]
    out = []
    for r in rounds:
        sdir = layout.folder(cfg.run_dir, j, folder, r)
        out += [str(sdir / p["file"]) for p in (manifests.manifest(sdir) or {}).get("parts", [])]
    return out


CANDIDATES = """
WITH scored AS (
    SELECT r.*, s.* EXCLUDE (rollout_id, prompt_id)
    FROM read_parquet($rollouts, union_by_name = true) r
    JOIN read_parquet($scores, union_by_name = true) s USING (rollout_id)
)
SELECT a.rollout_id FROM read_parquet($advantages, union_by_name = true) a
WHERE a.rollout_id IN (SELECT rollout_id FROM scored WHERE ({where}))
ORDER BY a.rollout_id
"""


def choose(con: Any, cfg: Config, iteration: int, own_rows: int) -> Replayed:
    """The seeded choice of replayed rows (rollout ids per source iteration)."""
    import duckdb

    r = cfg.advantage.replay
    found: list[tuple[int, str]] = []
    for j in sources(cfg, iteration):
        fs.register(con, layout.iter_dir(cfg.run_dir, j))
        files = {f: _files(cfg, j, f) for f in (layout.ROLLOUTS, layout.SCORES, layout.ADVANTAGES)}
        if not files[layout.ADVANTAGES]:
            continue  # an iteration whose every row was filtered out
        if cfg.advantage.estimator == "opd":
            _check_token_advantages(cfg, iteration, j)
        try:
            rows = con.execute(CANDIDATES.replace("{where}", r.get("where", "true")), files).fetchall()
        except duckdb.Error as e:
            line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
            raise StageError(
                f"advantage.replay.where: {line} (over iteration {j}'s scored rollouts)"
            ) from None
        found += [(j, row[0]) for row in rows]
    most = cap(own_rows, float(r["max_share"]))
    picked = found
    if len(found) > most:
        order = np.random.default_rng([cfg.seed, iteration]).permutation(len(found))[:most]
        picked = sorted(found[i] for i in order)
    out = Replayed(candidates=len(found), cap=most)
    for j, rid in picked:
        out.ids.setdefault(j, []).append(rid)
    return out


def _columns(cfg: Config, j: int) -> set[str]:
    """The columns any part of iteration j's advantages has (from the Parquet footers)."""
    sdir = layout.folder(cfg.run_dir, j, layout.ADVANTAGES)
    parts = (manifests.manifest(sdir) or {}).get("parts", [])
    return {name for p in parts for name in manifests.parquet_file(sdir / p["file"]).schema_arrow.names}


def _check_token_advantages(cfg: Config, iteration: int, j: int) -> None:
    """opd replays only rows that have their per-token advantages (rows of an opd iteration)."""
    if "token_advantages" not in _columns(cfg, j):
        sdir = layout.folder(cfg.run_dir, j, layout.ADVANTAGES)
        raise StageError(
            f"advantage.replay: {sdir} has no token_advantages (written with another "
            f"advantage.estimator than opd), so its rows cannot be replayed into opd iteration "
            f"{iteration}; redo it with {layout.redo_command(sdir)} or lower advantage.replay.iterations"
        )


def parts(chosen: Replayed | None, rows_per_part: int) -> int:
    return 0 if chosen is None else math.ceil(chosen.rows / rows_per_part)


def rows_table(con: Any, cfg: Config, iteration: int, chosen: Replayed, schema: pa.Schema) -> pa.Table:
    """The replayed rows as stored, columns of `schema`, in the seeded hash order."""
    import hashlib

    def query(j: int) -> str:  # a column a source lacks (a single-turn source's loss_mask): null
        have = _columns(cfg, j)
        cols = ", ".join(f'"{c}"' if c in have else f'NULL AS "{c}"' for c in schema.names)
        return f"SELECT {cols} FROM read_parquet($files, union_by_name = true) WHERE rollout_id IN (SELECT unnest($ids))"

    tables = [
        con.sql(query(j), params={"files": _files(cfg, j, layout.ADVANTAGES), "ids": ids})
        .to_arrow_reader()
        .read_all()
        .cast(schema)
        for j, ids in chosen.ids.items()
    ]
    table = pa.concat_tables(tables)
    keys = [f"{cfg.seed}:{iteration}:replay:{rid}" for rid in table.column("rollout_id").to_pylist()]
    order = sorted(range(table.num_rows), key=lambda i: (hashlib.md5(keys[i].encode()).hexdigest(), keys[i]))
    return table.take(pa.array(order, pa.int64()))


def write_parts(
    con: Any, cfg: Config, iteration: int, chosen: Replayed, first: int, todo: list[int], out: Any, bar: Any
) -> None:
    """Write the replay parts among `todo` (part `first` + i holds rows [i R, (i + 1) R))."""
    from rlhf_batch.stages.base import Part, list_tokens
    from rlhf_batch.store.schemas import ADVANTAGES, LOSS_MASK, TOKEN_ADVANTAGES, with_extra

    mine = [n for n in todo if n >= first]
    if not mine:
        return
    schema = with_extra(ADVANTAGES, TOKEN_ADVANTAGES) if cfg.advantage.estimator == "opd" else ADVANTAGES
    if any(LOSS_MASK.names[0] in _columns(cfg, j) for j in chosen.ids):  # multi-turn rows keep their mask
        schema = with_extra(schema, LOSS_MASK)  # (null in a single-turn source's rows: all ones)
    table, size = rows_table(con, cfg, iteration, chosen, schema), cfg.advantage.rows_per_part
    for n in mine:
        part = table.slice((n - first) * size, size)
        out.write(n, Part(part, schema, tokens=list_tokens(part, "input_ids")))
        bar.update(1)


def record(cfg: Config, iteration: int, chosen: Replayed) -> dict[str, Any]:
    """What the advantage manifest's `replay` records."""
    return {
        "candidates": chosen.candidates,
        "max_rows": chosen.cap,
        "rows": chosen.rows,
        "from": {
            str(j): {
                "rows": len(ids),
                "staleness": iteration - j + staleness(j, cfg.max_staleness),
                "rollout_ids": ids,
            }
            for j, ids in chosen.ids.items()
        },
    }
