"""A long run: does the cost of an iteration grow with the iterations before it?

One `run` of pipelines/demo.toml in this process (in_process), shrunk to tiny iterations (4
prompts x 2 samples, 4 new tokens, one optimizer step), for --iterations iterations (default
1,000; --tiny: 20). Measured:

- "long run: overhead per iteration": each iteration's wall time inside `run` (run_iteration,
  the reward and train health checks included) minus its stages' own work (the `work_s` of each
  stage manifest's timing: what is left is start-up, input reads, manifests, checks, polling),
  the mean of the first 50 iterations after iteration 0 (which imports and loads the models)
  against the last 50 (a tenth of the run each when shorter).
  Target: last <= 1.2 x first.
- "long run: status", "long run: sql aggregate", "long run: report": each command over the
  finished run, a process of its own (interpreter start and imports included), wall seconds.
  Targets (at 1,000 iterations): 5 s, 2 s, 30 s.
- "long run: run directory per iteration": its files and bytes over the iterations, with the
  default retention.

The machine is usually shared: read the ratio of overheads, not the seconds.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import append_row  # noqa: E402

TINY = [  # a tiny iteration: every stage runs, on next to no rows
    "generate.prompts_per_iteration=4",
    "generate.num_generations=2",
    "generate.max_new_tokens=4",
    "generate.batch_size=8",
    "generate.prompts_per_part=4",
    "train.sequences_per_step=8",
    "train.max_tokens_per_batch=1024",
]
SQL = "SELECT iter, avg(score) AS score FROM scores GROUP BY iter ORDER BY iter"
TARGETS = {"status": 5.0, "sql aggregate": 2.0, "report": 30.0}  # seconds, at 1,000 iterations


def long_run(run_dir: Path, iterations: int, log: Path | None = None) -> dict[int, float]:
    """The run, in this process; the wall seconds of each iteration's `run_iteration` (with `log`:
    also a line "iteration wall work" there as each ends, for a run stopped early)."""
    from rlhf_batch.commands import pipeline

    walls: dict[int, float] = {}
    inner = pipeline.run_iteration

    def timed(cfg: Any, it: int, *args: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        inner(cfg, it, *args, **kw)
        walls[it] = time.perf_counter() - t0
        if log is not None:
            with log.open("a") as f:
                f.write(f"{it} {walls[it]:.4f} {stage_work(run_dir, it):.4f}\n")

    pipeline.run_iteration = timed  # type: ignore[assignment]
    try:
        overrides = [
            f"run_dir={run_dir}",
            f"iterations={iterations}",
            f"train.total_steps={iterations}",
            *TINY,
        ]
        with contextlib.redirect_stdout(io.StringIO()):  # its summary table and report line
            pipeline.run_pipeline(
                common.ROOT / "pipelines" / "demo.toml", overrides, quiet=True, settle_heap=True
            )
    finally:
        pipeline.run_iteration = inner  # type: ignore[assignment]
    return walls


def stage_work(run_dir: Path, it: int) -> float:
    """The work_s of every stage manifest of iteration `it` (top-up rounds included)."""
    import json

    from rlhf_batch.store import layout

    total = 0.0
    for m in layout.iter_dir(run_dir, it).glob(f"**/{layout.MANIFEST}"):
        total += float((json.loads(m.read_text()).get("timing") or {}).get("work_s") or 0.0)
    return total


def cli_seconds(*args: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlhf_batch", *args], check=True, env=env, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    p = common.parser(__doc__ or "")
    p.add_argument("--iterations", type=int, help="iterations of the run (default 1000; --tiny: 20)")
    p.add_argument("--keep", type=Path, help="run here and keep the run directory (default: a temporary one)")
    p.add_argument("--log", type=Path, help="append 'iteration wall work' here as each iteration ends")
    args = p.parse_args()
    n = args.iterations or (20 if args.tiny else 1000)
    common.CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        run_dir = args.keep or Path(tmp) / "run"
        walls = long_run(run_dir, n, args.log)
        # iteration 0 apart: it imports torch and DuckDB and loads the models first
        over = [walls[it] - stage_work(run_dir, it) for it in sorted(walls) if it > 0]
        k = min(50, max(1, len(over) // 10))
        first, last = sum(over[:k]) / k, sum(over[-k:]) / k
        work = f"pipelines/demo.toml, {n} tiny iterations (4 prompts x 2, 4 new tokens), in process"
        append_row(
            args.results,
            "long run: overhead per iteration",
            work,
            f"s per iteration outside the stages' work, last {k} / first {k}",
            f"{last:.3f}",
            f"{first:.3f}",
            f"{last / first:.2f}x",
            target="<= 1.2x",
            met=last <= 1.2 * first,
        )
        timed = {
            "status": cli_seconds("status", str(run_dir)),
            "sql aggregate": cli_seconds("sql", "--run-dir", str(run_dir), SQL),
            "report": cli_seconds("report", str(run_dir)),
        }
        for name, seconds in timed.items():
            append_row(
                args.results,
                f"long run: {name}",
                work,
                "s (a process of its own, imports included)",
                f"{seconds:.2f}",
                target=f"<= {TARGETS[name]:g} s at 1,000 iterations",
                met=seconds <= TARGETS[name] if n >= 1000 else None,
            )
        files = [f for f in run_dir.rglob("*") if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        append_row(
            args.results,
            "long run: run directory per iteration",
            work + ", default retention",
            "files / KiB per iteration",
            f"{len(files) / n:.1f} / {size / n / 1024:.1f}",
        )


if __name__ == "__main__":
    main()
