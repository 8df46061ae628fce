"""Bounded staleness, measured: the learning benchmark's task (bench_learning.py: the demo task, a tiny
model initialised per seed, 256 prompts, 64 per iteration x G 8, 40 iterations) run by `rlhf-batch run`
with max_staleness S = 0, 1 and 2 on the same seeds, each run a whole process of its own.

S = 0 (lock-step) gets both cores for every stage (threads = 2); S > 0 (overlapped: a sample lane,
generate + score of the iterations ahead, and a learn lane, top-up + advantage + train + eval) one
core per lane (threads = 1, generate.threads = 1, train.threads = 1; `--lock-step-threads 1` gives
lock-step the demo's one thread: a second baseline). The runs of one seed go one after the other,
S = 0 first, so the machine's drift falls on every S alike. Recorded per run: the whole process's wall
time; the mean score of each iteration's rollouts (DuckDB over the views of `rlhf-batch sql`: the
scores of round 0) and when it was known (the mtime of that iteration's scores manifest, from the
process's start); each lane's idle fraction, 1 - (the startup_s + work_s of its stages, from the
manifests' timing: the stages view) / the whole process's wall time (sample lane: rollouts and
scores of round 0; learn lane: every other stage). Over the seeds, the seed-mean curve: per
iteration, the mean score and the mean time at which it was known.

Targets, for S = 1 against S = 0: it reaches lock-step's final seed-mean score in at least 1.3x less
wall time (time to reach: the seed-mean time of the first iteration whose seed-mean score is at
least that score, the same rule for both); and its final seed-mean score is within the seeds' noise
of lock-step's: |difference| <= 2 standard errors of the difference of the two seed means,
sqrt(s0^2 / n + s1^2 / n), s the sample standard deviation (n - 1) over the n seeds.

Writes benchmarks/results/staleness.json and staleness.png (mean score vs wall time per S, the
seeds' mean with a band of one standard error), rows to benchmarks/results.md.

    make bench-staleness
    .venv/bin/python benchmarks/bench_staleness.py --seeds 0,1 --iterations 3    # a smoke run
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_learning  # noqa: E402
import common  # noqa: E402

BIN = Path(sys.executable).parent / "rlhf-batch"
SAMPLE_LANE = ("rollouts", "scores")  # of round 0; every other stage is the learn lane's
SPEEDUP_TARGET = 1.3
SCORES_SQL = "SELECT iter, avg(score) AS score FROM scores WHERE topup = 0 GROUP BY iter ORDER BY iter"
BUSY_SQL = (
    "SELECT iter, stage, topup, coalesce(startup_s, 0) + coalesce(work_s, 0) AS busy_s "
    "FROM stages ORDER BY iter, topup, stage"
)


# ---------------------------------------------------------------- pure helpers (tested)


def idle_fraction(busy_s: list[float], wall_s: float) -> float:
    """1 - (a lane's busy seconds) / (the whole process's wall seconds)."""
    return 1.0 - sum(busy_s) / wall_s


def lane_busy(stages: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The busy seconds of each stage row (stage, topup, busy_s), by lane."""
    lanes: dict[str, list[float]] = {"sample": [], "learn": []}
    for s in stages:
        sample = s["stage"] in SAMPLE_LANE and not s["topup"]
        lanes["sample" if sample else "learn"].append(float(s["busy_s"]))
    return lanes


def time_to_reach(times: list[float], scores: list[float], target: float) -> float | None:
    """The time of the first point whose score is >= target (None: never)."""
    return next((t for t, s in zip(times, scores, strict=True) if s >= target), None)


def seed_mean(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per iteration over the seeds' runs: mean time known, mean score, the score's standard error."""
    n = len(runs)
    scores = list(zip(*(r["scores"] for r in runs), strict=True))
    return {
        "times": [statistics.fmean(ts) for ts in zip(*(r["known_s"] for r in runs), strict=True)],
        "scores": [statistics.fmean(s) for s in scores],
        "se": [statistics.stdev(s) / math.sqrt(n) if n > 1 else 0.0 for s in scores],
    }


def within_noise(base: list[float], other: list[float]) -> dict[str, float | bool]:
    """Final scores of the seeds of two modes: the difference of their means, the noise (2 standard
    errors of that difference, sample std over the seeds) and whether the difference is within it."""
    diff = statistics.fmean(other) - statistics.fmean(base)
    var = sum(statistics.variance(x) / len(x) for x in (base, other)) if len(base) > 1 else 0.0
    noise = 2 * math.sqrt(var)
    return {"difference": diff, "noise": noise, "within": abs(diff) <= noise}


# ---------------------------------------------------------------- one run


def sql(run_dir: Path, query: str) -> list[dict[str, Any]]:
    """`query` over the run's views (those of `rlhf-batch sql`), as dicts."""
    from rlhf_batch.observe.query import connect

    con = connect(run_dir)
    try:
        cur = con.execute(query)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    finally:
        con.close()


def lane_settings(staleness: int, lock_step_threads: int = 2) -> tuple[int, list[str], str]:
    """Threads and per-lane overrides of each mode: both cores per stage lock-step, one core per lane
    overlapped; and how the rows name it."""
    if staleness == 0:
        return lock_step_threads, [], f"threads {lock_step_threads}"
    return 1, ["generate.threads=1", "train.threads=1"], "threads 1 per lane"


def run_once(spec: dict[str, Any], staleness: int) -> dict[str, Any]:
    """`rlhf-batch run` of one seed with max_staleness = `staleness`, a whole process."""
    threads, lanes, _ = lane_settings(staleness, spec["lock_step_threads"])
    run_dir = Path(spec["tmp"], f"s{staleness}")
    sets = [f"max_staleness={staleness}", *lanes]
    cmd = [str(BIN), "run", str(bench_learning.DEMO), "--quiet"]
    for s in bench_learning.overrides({**spec, "run_dir": str(run_dir), "threads": threads, "set": sets}):
        cmd += ["--set", s]
    start, t0 = time.time(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT, timeout=7200)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench_staleness: S={staleness} seed {spec['seed']} failed:\n{proc.stderr[-4000:]}")
    rows = sql(run_dir, SCORES_SQL)
    known = [
        (run_dir / f"iter={r['iter']:04d}" / "scores" / "_manifest.json").stat().st_mtime - start
        for r in rows
    ]
    busy = lane_busy(sql(run_dir, BUSY_SQL))
    return {
        "seed": spec["seed"],
        "max_staleness": staleness,
        "wall_s": wall,
        "scores": [r["score"] for r in rows],
        "known_s": known,
        "busy_s": {k: sum(v) for k, v in busy.items()},
        "idle": {k: idle_fraction(v, wall) for k, v in busy.items()},
    }


# ---------------------------------------------------------------- over the seeds


def summary(runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each S's seed-mean curve, wall time and idle fractions; each S > 0 against lock-step."""
    curves = {s: seed_mean(r) for s, r in runs.items()}
    target = curves[0]["scores"][-1]  # lock-step's final seed-mean score
    base_reach = time_to_reach(curves[0]["times"], curves[0]["scores"], target)
    out: dict[str, Any] = {"target_score": target, "lock_step_reach_s": base_reach, "modes": {}}
    for s, r in runs.items():
        reach = time_to_reach(curves[s]["times"], curves[s]["scores"], target)
        mode = {
            "curve": curves[s],
            "wall_s": statistics.fmean(x["wall_s"] for x in r),
            "idle": {k: statistics.fmean(x["idle"][k] for x in r) for k in ("sample", "learn")},
            "final_score": curves[s]["scores"][-1],
            "reach_s": reach,
            "speedup": base_reach / reach if reach and base_reach else None,
        }
        if s:
            mode["final_vs_lock_step"] = within_noise(
                [x["scores"][-1] for x in runs[0]], [x["scores"][-1] for x in r]
            )
        out["modes"][s] = mode
    return out


def record(results: Path, summ: dict[str, Any], workload: str, notes: dict[int, str]) -> None:
    """The rows of each S > 0 against lock-step: time to reach, final score, wall time and idle."""
    base = summ["modes"][0]
    for s, m in summ["modes"].items():
        if not s:
            continue
        what, load = f"S = {s} ({notes[s]}) vs lock-step ({notes[0]})", workload
        reach = "never" if m["reach_s"] is None else f"{m['reach_s']:.0f}s"
        common.append_row(
            results,
            "staleness: time to lock-step's final score",
            f"{load}; {what}",
            "seed-mean wall time",
            reach,
            f"{base['reach_s']:.0f}s (final score {summ['target_score']:.3f})",
            f"{m['speedup']:.2f}x" if m["speedup"] else "-",
            target=f">= {SPEEDUP_TARGET}x" if s == 1 else "-",
            met=(m["speedup"] or 0) >= SPEEDUP_TARGET if s == 1 else None,
        )
        n = m["final_vs_lock_step"]
        common.append_row(
            results,
            "staleness: final score",
            "as above",
            "seed-mean score at the last iteration",
            f"{m['final_score']:.3f}",
            f"{base['final_score']:.3f}",
            f"difference {n['difference']:+.3f}, noise {n['noise']:.3f} (2 SE of the difference)",
            target="within the noise" if s == 1 else "-",
            met=bool(n["within"]) if s == 1 else None,
        )
        common.append_row(
            results,
            "staleness: wall time and idle lanes",
            "as above",
            "whole-process wall time (seed mean); idle fraction sample / learn lane",
            f"{m['wall_s']:.0f}s; idle {m['idle']['sample']:.0%} / {m['idle']['learn']:.0%}",
            f"{base['wall_s']:.0f}s; idle {base['idle']['sample']:.0%} / {base['idle']['learn']:.0%}",
            f"{base['wall_s'] / m['wall_s']:.2f}x",
        )


def plot(path: Path, summ: dict[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for s, m in summ["modes"].items():
        c = m["curve"]
        lo = [y - e for y, e in zip(c["scores"], c["se"], strict=True)]
        hi = [y + e for y, e in zip(c["scores"], c["se"], strict=True)]
        (line,) = ax.plot(
            c["times"], c["scores"], marker=".", label=f"S = {s}" + (" (lock-step)" if not s else "")
        )
        ax.fill_between(c["times"], lo, hi, color=line.get_color(), alpha=0.2)
    ax.axhline(summ["target_score"], color="grey", lw=0.8, ls="--", label="lock-step's final score")
    ax.set(xlabel="wall time since the process started (s)", ylabel="mean score of the iteration's rollouts")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = common.parser(__doc__ or "")
    p.add_argument("--iterations", type=int, help="default 40 (the learning benchmark's), --tiny 2")
    p.add_argument("--seeds", help="comma-separated seeds (default 0..9, --tiny 0,1)")
    p.add_argument(
        "--staleness", help="values of max_staleness, 0 (the baseline) first (default 0,1,2, --tiny 0,1)"
    )
    p.add_argument(
        "--out", type=Path, help="folder of staleness.json and .png (default: results/ beside --results)"
    )
    p.add_argument(
        "--lock-step-threads", type=int, default=2, help="threads of every lock-step stage (default 2)"
    )
    args = p.parse_args()
    args.seeds = args.seeds or ("0,1" if args.tiny else ",".join(map(str, range(10))))
    args.staleness = args.staleness or ("0,1" if args.tiny else "0,1,2")
    args.out = args.out or args.results.parent / "results"
    seeds, values = [int(x) for x in args.seeds.split(",")], [int(x) for x in args.staleness.split(",")]
    if values[0] != 0 or len(values) < 2:
        raise SystemExit(
            "bench_staleness: --staleness must start with 0 (lock-step, the baseline) and name another S"
        )
    iterations = args.iterations or (2 if args.tiny else bench_learning.SHARED["iterations"])
    b = 16 if args.tiny else bench_learning.SHARED["prompts_per_iteration"]
    common.CACHE.mkdir(parents=True, exist_ok=True)
    runs: dict[int, list[dict[str, Any]]] = {s: [] for s in values}
    loads = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
            spec = {**bench_learning.seed_inputs(Path(tmp), seed), "tmp": tmp, "seed": seed}
            spec |= {
                "iterations": iterations,
                "prompts_per_iteration": b,
                "lock_step_threads": args.lock_step_threads,
            }
            for s in values:
                runs[s].append(run_once(spec, s))
                loads.append(common.loadavg())
                print(f"seed {seed} S={s}: {runs[s][-1]['wall_s']:.0f}s", file=sys.stderr, flush=True)
    summ = summary(runs)
    workload = (
        f"demo task, 256 prompts, {b} per iteration x G 8, {iterations} iterations, tiny Qwen2 (2 layers), "
        f"seeds {args.seeds}; `rlhf-batch run`, whole processes"
    )
    notes = {s: lane_settings(s, args.lock_step_threads)[2] for s in values}
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"workload": workload, "threads": notes, "machine": common.machine(), "loads": loads, "runs": runs}
    (args.out / "staleness.json").write_text(json.dumps({**doc, "summary": summ}, indent=1))
    record(args.results, summ, workload, notes)
    title = f"demo task, {b} prompts x 8 per iteration, {len(seeds)} seeds (band: 1 SE of their mean)"
    plot(args.out / "staleness.png", summ, title)
    print(f"results: {args.out / 'staleness.json'}, {args.out / 'staleness.png'}")


if __name__ == "__main__":
    main()
