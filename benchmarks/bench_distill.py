"""On-policy distillation on the demo task: a student distils a trained demo policy.

1. Teacher: pipelines/demo.toml (GRPO) for --teacher-iterations from the demo's fresh model.
2. Student, twice, from that same fresh model, prompts and seed, for --iterations: GRPO alone
   (the demo config) and advantage.estimator = "opd" with score.teacher_model = the teacher's
   last policy (pure distillation, advantage.opd_task_weight = 0: the task reward is not used
   for learning, only recorded); with --task-weight W > 0 a third run adds W x the GRPO group
   advantage of the task reward (advantage.opd_task_weight = W).
Each run is `rlhf-batch run` in a process of its own; the figure is the mean task score of the
rollouts of each iteration (the `scores` view), which both runs record the same way. Rows go
to benchmarks/results.md with the machine, the load and the date.

    python benchmarks/bench_distill.py [--teacher-iterations 20] [--iterations 8] [--task-weight W]
        [--baseline mean|none] [--tmp DIR]

--tiny (the smoke test): 2 teacher and 2 student iterations of 8 prompts; its rows mean nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BIN = Path(sys.executable).parent / "rlhf-batch"
DEMO = common.ROOT / "pipelines" / "demo.toml"
SCORES_SQL = "SELECT iter, avg(score) AS score FROM scores WHERE topup = 0 GROUP BY iter ORDER BY iter"


EXTRA: list[str] = []  # overrides of every run (--tiny: fewer prompts)


def run(run_dir: Path, iterations: int, sets: list[str]) -> list[float]:
    """`rlhf-batch run` of the demo config with `sets`; the mean score of each iteration."""
    from rlhf_batch.observe.query import connect

    cmd = [str(BIN), "run", str(DEMO), "--quiet", "--set", f"run_dir={run_dir}"]
    for s in [f"iterations={iterations}", *EXTRA, *sets]:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench_distill: {run_dir.name} failed:\n{proc.stderr[-4000:]}")
    con = connect(str(run_dir))
    try:
        return [float(s) for _, s in con.execute(SCORES_SQL).fetchall()]
    finally:
        con.close()


def compare(
    tmp: Path, teacher_iterations: int, iterations: int, task_weight: float = 0.0, baseline: str = "mean"
) -> dict[str, Any]:
    teacher_dir = tmp / "teacher"
    teacher_scores = run(teacher_dir, teacher_iterations, [])  # builds the fresh model and prompts
    teacher = teacher_dir / f"iter={teacher_iterations - 1:04d}" / "policy"
    start = [  # the teacher's fresh model and prompts: the student's start is the teacher's
        f"policy_model={teacher_dir / 'models' / 'policy'}",
        f"generate.prompts={teacher_dir / 'data' / 'prompts.jsonl'}",
        "demo=false",
    ]
    grpo = run(tmp / "grpo", iterations, start)
    distil = [
        *start,
        "advantage.estimator=opd",
        f"score.teacher_model={teacher}",
        f"advantage.opd_baseline={baseline}",
    ]
    out = {"teacher": teacher_scores, "grpo": grpo, "opd": run(tmp / "opd", iterations, distil)}
    if task_weight > 0:
        out["opd_task"] = run(
            tmp / "opd_task", iterations, [*distil, f"advantage.opd_task_weight={task_weight}"]
        )
    return out


def main() -> None:
    ap = common.parser(__doc__ or "")
    ap.add_argument("--teacher-iterations", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--task-weight", type=float, default=0.0, help="> 0: also OPD + W x the GRPO advantage")
    ap.add_argument("--baseline", choices=["mean", "none"], default="mean", help="advantage.opd_baseline")
    ap.add_argument("--tmp", type=Path, default=None, help="where the runs go (default: a temporary dir)")
    ap.add_argument("--no-record", action="store_true", help="print, do not append to results.md")
    args = ap.parse_args()
    if args.tiny:
        args.teacher_iterations, args.iterations = 2, 2
        EXTRA.append("generate.prompts_per_iteration=8")
    tmp = args.tmp or Path(tempfile.mkdtemp(prefix="bench-distill-"))
    load0 = os.getloadavg()[0]
    res = compare(tmp, args.teacher_iterations, args.iterations, args.task_weight, args.baseline)
    load = max(load0, os.getloadavg()[0])
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    print(f"teacher ({args.teacher_iterations} GRPO iterations): {fmt(res['teacher'])}")
    print(f"student GRPO: {fmt(res['grpo'])}\nstudent OPD:  {fmt(res['opd'])}")
    task = f"; OPD + {args.task_weight:g} x GRPO {fmt(res['opd_task'])}" if "opd_task" in res else ""
    print(f"{task.lstrip('; ')}\nload {load:.1f}")
    if not args.no_record:
        work = (
            f"demo task, tiny Qwen2 (2 layers), 64 prompts x G 8 per iteration; teacher = the demo policy "
            f"after {args.teacher_iterations} GRPO iterations (final score {res['teacher'][-1]:.3f}); "
            f"student from the same fresh model, {args.iterations} iterations, opd_baseline {args.baseline}; mean score per iteration "
            f"0..{args.iterations - 1}: OPD {fmt(res['opd'])}; GRPO {fmt(res['grpo'])}{task}; 1-min load {load:.1f}"
        )
        common.append_row(
            args.results,
            "on-policy distillation vs GRPO",
            work,
            f"mean score at iteration {args.iterations - 1} (OPD / GRPO alone)",
            f"{res['opd'][-1]:.3f}",
            f"{res['grpo'][-1]:.3f}",
        )
    if args.tmp is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
