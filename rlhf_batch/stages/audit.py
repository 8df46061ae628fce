"""audit: stored rollouts re-scored with verifiers that never enter the reward, into iter=K/audit.

`score.audit_functions` name functions as `score.reward_functions` do (``"pkg.mod:fn"``, the
``trl:`` and ``verl:`` prefixes, ``as NAME``, imported from `score.reward_paths`) and are called
as score calls reward functions (rewards/cache.py: the same conventions, time limit, async
calls and reward cache). Rows: `rollout_id`, `prompt_id`, `topup` (the round) and one column
``audit_<name>`` per function (float64, null where it returned None; a verl dict result's other
keys as ``audit_<name>_<key>``), one row per rollout of the iteration's round 0 and of each
complete top-up round, in that order. Part n holds rows [n R, (n + 1) R), R = `score.rows_per_part`.

Nothing else is read or written: no model is loaded, scores, advantages and training are
untouched, and `run` never runs it (`rlhf-batch audit CONFIG --iter K`, or a range). Its
identity is `score.audit_functions`: the folder is complete once and refused under another list
without `--force`, as every stage's; its inputs are the rollouts manifests it read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlhf_batch.config import Config, reward_search_path
from rlhf_batch.data.topup import rounds_taken
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.rewards import RewardFunction, load_reward_functions
from rlhf_batch.rewards.cache import RewardCalls
from rlhf_batch.rewards.conventions import check_arguments
from rlhf_batch.stages.base import Part, Stage, list_tokens
from rlhf_batch.store import layout
from rlhf_batch.store.manifests import manifest, read_complete
from rlhf_batch.store.schemas import AUDIT, ROLLOUTS, with_extra

PREFIX = "audit_"


def audit_column(column: str) -> str:
    """reward_<name>[_<key>] (the reward functions' naming) -> audit_<name>[_<key>]."""
    return PREFIX + column.removeprefix("reward_")


class Audit(Stage):
    name, folder, unit = "audit", layout.AUDIT, "row"
    in_pipeline = False  # a command of its own: `run` never runs it

    def __init__(self, cfg: Config, iteration: int):
        super().__init__(cfg, iteration)
        self.fns: list[RewardFunction]  # prepare(): the audit functions
        self.rounds: list[Path]  # prepare(): the rollouts folders audited (round 0, then top-ups)
        self.rows: int  # prepare(): their rows
        self.rollouts: pa.Table  # open(): the rollouts, with their round in `topup`
        self.calls: RewardCalls  # open(): how the functions are called (and cached)

    @classmethod
    def runs_at(cls, cfg: Config, iteration: int) -> bool:
        return False

    def prepare(self) -> None:
        cfg, it = self.cfg, self.iteration
        key = "score.audit_functions"
        self.fns = load_reward_functions(
            cfg.score.audit_functions, (), AUDIT.names, reward_search_path(cfg), key
        )
        if not self.fns:
            raise ConfigError(f"{key}: no audit function; name at least one ('package.module:function')")
        self.rounds = [layout.folder(cfg.run_dir, it, layout.ROLLOUTS)]
        if manifest(self.rounds[0]) is None:
            raise StageError(
                f"{self.rounds[0]}: rollouts are not complete; nothing to audit in iteration {it}"
            )
        self.rounds += [
            layout.folder(cfg.run_dir, it, layout.ROLLOUTS, r)
            for r in range(1, rounds_taken(cfg.run_dir, it) + 1)
        ]
        found = [manifest(d) or {} for d in self.rounds]
        self.rows = sum(int(m["rows"]) for m in found)
        self.fingerprints = {"rollouts": [{k: m[k] for k in ("key", "rows")} for m in found]}

    def plan(self) -> int:
        return math.ceil(self.rows / self.cfg.score.rows_per_part)

    def open(self, todo: list[int]) -> None:
        tables = []
        for r, d in enumerate(self.rounds):
            t = read_complete(d, ROLLOUTS)
            check_arguments(self.fns, [c for c in t.column_names if c not in ROLLOUTS.names], str(d))
            tables.append(t.append_column("topup", pa.array([r] * t.num_rows, pa.int32())))
        self.rollouts = pa.concat_tables(tables, promote_options="permissive")
        self.calls = RewardCalls.from_config(self.cfg)

    def write_part(self, n: int, bar: Any) -> Part:
        rows = self.cfg.score.rows_per_part
        t = self.rollouts.slice(n * rows, rows)
        rid = t["rollout_id"].to_pylist()
        batch = self.calls.batch(
            t.drop_columns(["topup"]), t["prompt_ids"].to_pylist(), t["response_ids"].to_pylist()
        )
        values, extra = self.calls.values(self.fns, rid, batch)
        cols: dict[str, pa.Array] = {c: t[c].combine_chunks() for c in AUDIT.names}
        cols |= {audit_column(c): pa.array(v, pa.float64()) for c, v in values.items()}
        cols |= {audit_column(c): a for c, a in extra.items()}
        out = pa.table(cols)
        schema = with_extra(AUDIT, out.schema)
        counts = {
            "rows": t.num_rows,
            **{f"unscored_{audit_column(c)}": sum(x is None for x in v) for c, v in values.items()},
        }
        bar.update(t.num_rows)
        return Part(
            out, schema, {**counts, **self.calls.take_counts()}, list_tokens(t, "prompt_ids", "response_ids")
        )

    def progress_total(self, todo: list[int]) -> int:
        rows = self.cfg.score.rows_per_part
        return sum(min(rows, self.rows - n * rows) for n in todo)

    def manifest_extra(self) -> dict[str, Any]:
        return {"audit_functions": [rf.path for rf in self.fns]}
