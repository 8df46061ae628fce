"""`make bench`: measure the matmul peaks, then run every benchmark, appending rows to
benchmarks/results.md, then rewrite the Performance table of docs/performance.md from it (benchmarks/table.py).
`--tiny` runs everything on the tiny model and workload (the smoke test).
Each benchmark runs in its own process and each measurement in a fresh worker process.
It says which CPU it found and what dtype auto is there; it refuses to start while the machine
is busy (1-minute load average above half the cores) unless --allow-busy; rows measured under
load are marked "busy" and left out of that table."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BENCHMARKS = (
    "bench_startup.py",
    "bench_score.py",
    "bench_generate.py",
    "bench_advantage.py",
    "bench_train.py",
    "bench_proxies.py",
    "bench_long_run.py",
)


def main() -> None:
    p = common.parser(__doc__ or "")
    p.add_argument("--only", nargs="*", help="run only these benchmarks (e.g. bench_score.py)")
    p.add_argument(
        "--allow-busy", action="store_true", help="measure even if the machine is busy (rows marked busy)"
    )
    args = p.parse_args()
    print(common.cpu_kind_line(), flush=True)
    refusal = common.start_refusal(common.loadavg(), common.CORES)
    if refusal and not (args.tiny or args.allow_busy):
        raise SystemExit(refusal)
    common.CACHE.mkdir(parents=True, exist_ok=True)
    extra = ["--tiny"] if args.tiny else []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        peaks = Path(tmp) / "peaks.json"
        subprocess.run(
            [sys.executable, str(common.HERE / "peak.py"), "--out", str(peaks), *extra], check=True
        )
        import json

        common.append_peak_row(args.results, json.loads(peaks.read_text()))
        failed = []
        for name in args.only or BENCHMARKS:
            t0 = time.perf_counter()
            cmd = [
                sys.executable,
                str(common.HERE / name),
                "--peaks",
                str(peaks),
                "--results",
                str(args.results),
            ]
            if subprocess.run(cmd + extra).returncode != 0:
                failed.append(name)
            print(f"# {name}: {time.perf_counter() - t0:.0f}s", flush=True)
    print(f"# all benchmarks: {time.perf_counter() - t_all:.0f}s; rows appended to {args.results}")
    if not args.tiny and args.results.resolve() == common.RESULTS:
        import table

        table.update_readme(table.PAGE, args.results)
        print("# docs/performance.md: table rewritten from the latest complete quiet run of each CPU kind")
    if failed:
        raise SystemExit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
