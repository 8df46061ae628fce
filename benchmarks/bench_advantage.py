"""advantage: group statistics in DuckDB against a per-prompt Python queue (TorchRL MCAdvantage).

Data: synthetic complete rollouts + scores stages (written in 1M-row chunks by DuckDB, never
through Python lists) of N rollouts, 8 per prompt, rewards in [0, 1), 5% truncated rows,
4 prompt and 4 response tokens per row (short lists keep 10M rows within a few GB of Parquet;
the group statistics never read the token lists).

Ours: (a) "group statistics" = the advantage stage's pool + integrity check + groups + counts
(rlhf_batch/sql/advantage_{pool,aligned,groups,counts}.sql and the duplicate-id check; the exact
path, advantage_{pool_joined,check}.sql, runs only on bad or reordered input), reading the Parquet parts;
(b) the whole stage (`run_stage("advantage", ...)`) including sorting and writing the training parts, for
its time and peak RSS. Baseline (THE BASELINE below, what TorchRL's MCAdvantage does): rows
arrive one by one as TensorDicts (built before the clock starts); each goes into a deque per
prompt; when a prompt's deque holds G rows they are concatenated and get (r - mean) / std
(torch, std clamped at 1e-6). Both run on the same first 100k rows. Imports (duckdb and the
stage module; torch and tensordict for the baseline) happen before either clock starts.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Mem, append_row, emit, mb  # noqa: E402

from rlhf_batch.stages.registry import run_stage

CHUNK = 1_000_000

ROLLOUT_SQL = """
SELECT '0000-p' || (i // 8) || '-' || (i % 8) AS rollout_id, 'p' || (i // 8) AS prompt_id,
       (i % 8)::INTEGER AS sample_idx, 'q' AS prompt, [1, 2, 3, 4]::INTEGER[] AS prompt_ids, 'r' AS response,
       [5, 6, 7, 8]::INTEGER[] AS response_ids, [-1.0, -1.0, -1.0, -1.0]::FLOAT[] AS behavior_logprobs,
       CASE WHEN hash(i, 7) % 20 = 0 THEN 'length' ELSE 'stop' END AS finish_reason, 'bench' AS policy
FROM range($lo, $hi) t(i)
"""
SCORE_SQL = """
SELECT '0000-p' || (i // 8) || '-' || (i % 8) AS rollout_id, 'p' || (i // 8) AS prompt_id,
       r AS reward_raw, r AS score, [-1.1, -1.1, -1.1, -1.1]::FLOAT[] AS ref_logprobs,
       [0.1, 0.1, 0.1, 0.1]::FLOAT[] AS kl, 0.4::DOUBLE AS kl_sum, 0.0::DOUBLE AS kl_coef, r AS reward
FROM (SELECT i, (hash(i) % 1000000) / 1e6 AS r FROM range($lo, $hi) t(i))
"""


def write_data(run_dir: Path, rows: int) -> None:
    """Complete iter=0 rollouts and scores stages of `rows` rows, one part per CHUNK rows."""
    import duckdb

    from rlhf_batch.store import layout, output
    from rlhf_batch.store.schemas import ROLLOUTS, SCORES

    con = duckdb.connect()
    for stage_name, sql, schema in (("rollouts", ROLLOUT_SQL, ROLLOUTS), ("scores", SCORE_SQL, SCORES)):
        stage = output.claim(layout.folder(run_dir, 0, stage_name), stage_name, {"bench": True}, {}, True)
        n_parts = -(-rows // CHUNK)
        for n in range(n_parts):
            table = con.sql(sql, params={"lo": n * CHUNK, "hi": min(rows, (n + 1) * CHUNK)}).to_arrow_table()
            stage.write_table(n, table, schema)
        stage.finish(n_parts)
    con.close()


def config(run_dir: Path) -> Any:
    from rlhf_batch.config import load_config

    return load_config(None, [f"run_dir={run_dir}", "device=cpu"])


def group_stats(run_dir: Path) -> dict[str, int]:
    """Ours (a): the stage's group-statistics queries, as the stage runs them."""
    from rlhf_batch.stages import advantage

    cfg = config(run_dir)
    con = advantage._connect(run_dir / "duckdb.tmp")
    try:
        advantage._prepare(con, cfg, 0, [0])
        return advantage._counts(con, cfg, 0)
    finally:
        con.close()


class MCAdvantageBaseline:
    """THE BASELINE: a per-prompt queue like torchrl.envs.llm.MCAdvantage (grpo_size rows)."""

    def __init__(self, grpo_size: int):
        self.grpo_size = grpo_size
        self.queues: dict[str, deque] = defaultdict(lambda: deque(maxlen=grpo_size))

    def add(self, prompt: str, td: Any) -> Any:
        import torch

        self.queues[prompt].append(td)
        if len(self.queues[prompt]) == self.grpo_size:
            tds = torch.cat(list(self.queues[prompt]), 0)
            reward = tds["reward"]  # [G, 1]
            tds["advantage"] = (reward - reward.mean()) / reward.std().clamp_min(1e-6)
            return tds
        return None


def worker_baseline(spec: dict[str, Any]) -> dict[str, Any]:
    import duckdb
    import torch
    from tensordict import TensorDict

    files = str(Path(spec["run_dir"]) / "iter=0000" / "scores" / "*.parquet")
    rows = duckdb.sql(
        f"SELECT prompt_id, reward FROM read_parquet('{files}') LIMIT {spec['rows']}"
    ).fetchall()
    tds = [(p, TensorDict({"reward": torch.tensor([[r]])}, batch_size=[1])) for p, r in rows]
    t0 = time.perf_counter()
    mc = MCAdvantageBaseline(common.GROUP)
    done = sum(1 for p, td in tds if mc.add(p, td) is not None)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": len(tds), "groups": done}


def worker_stats(spec: dict[str, Any]) -> dict[str, Any]:
    import duckdb  # noqa: F401  (imported before the clock, like the baseline's torch and tensordict)

    from rlhf_batch.stages import advantage  # noqa: F401

    mem = Mem()
    t0 = time.perf_counter()
    counts = group_stats(Path(spec["run_dir"]))
    return {"seconds": time.perf_counter() - t0, "rows": counts["rows_in"], "peak_above": mem.peak_above()}


def worker_stage(spec: dict[str, Any]) -> dict[str, Any]:

    mem = Mem()
    t0 = time.perf_counter()
    m = run_stage("advantage", config(Path(spec["run_dir"])), 0, force=True, quiet=True)
    return {
        "seconds": time.perf_counter() - t0,
        "rows_out": m["rows"],
        "peak_rss": mem.peak_above() + mem.base,
    }


def worker_write(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    write_data(Path(spec["run_dir"]), spec["rows"])
    return {"seconds": time.perf_counter() - t0}


WORKERS = {"baseline": worker_baseline, "stats": worker_stats, "stage": worker_stage, "write": worker_write}


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    if args.worker:
        emit(WORKERS[args.worker](json.loads(args.spec)))
        return
    tiny = args.tiny
    big, small = (20_000, 2_000) if tiny else (10_000_000, 100_000)
    common.CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        d_small, d_big = Path(tmp) / "small", Path(tmp) / "big"
        for d, n in ((d_small, small), (d_big, big)):
            common.run_worker("bench_advantage.py", "write", {"run_dir": str(d), "rows": n, "tiny": tiny})
        base = common.run_worker(
            "bench_advantage.py", "baseline", {"run_dir": str(d_small), "rows": small, "tiny": tiny}
        )
        ours_small = common.run_worker("bench_advantage.py", "stats", {"run_dir": str(d_small), "tiny": tiny})
        ours_big = common.run_worker("bench_advantage.py", "stats", {"run_dir": str(d_big), "tiny": tiny})
        stage = common.run_worker("bench_advantage.py", "stage", {"run_dir": str(d_big), "tiny": tiny})
    rps_b, rps_s = base["rows"] / base["seconds"], ours_small["rows"] / ours_small["seconds"]
    rps_big = ours_big["rows"] / ours_big["seconds"]
    append_row(
        args.results,
        "advantage vs MCAdvantage",
        f"{small} rollouts, 8 per prompt",
        "rows/s (group statistics -> advantages)",
        f"{rps_s:,.0f}",
        f"{rps_b:,.0f}",
        f"{rps_s / rps_b:.0f}x",
        target=">= 500x",
        met=rps_s / rps_b >= 500,
    )
    append_row(
        args.results,
        "advantage group statistics",
        f"{big:,} rollouts, 8 per prompt",
        "rows/s",
        f"{rps_big:,.0f} ({ours_big['seconds']:.1f}s)",
        mem=mb(ours_big["peak_above"]),
        target=">= 5M rows/s",
        met=rps_big >= 5e6,
    )
    append_row(
        args.results,
        "advantage stage peak memory",
        f"{big:,} rollouts -> {stage['rows_out']:,} training rows, parts written, {stage['seconds']:.0f}s",
        "peak RSS of the whole stage process",
        mb(stage["peak_rss"]),
        mem=mb(stage["peak_rss"]),
        target="< 2 GB",
        met=stage["peak_rss"] < 2 * 2**30,
    )


if __name__ == "__main__":
    main()
