"""`make bench`: measure the matmul peaks, then run every benchmark, appending rows to
benchmarks/results.md. `--tiny` runs everything on the tiny model and workload (the smoke test).
Each benchmark runs in its own process and each measurement in a fresh worker process."""

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
)


def main() -> None:
    p = common.parser(__doc__ or "")
    p.add_argument("--only", nargs="*", help="run only these benchmarks (e.g. bench_score.py)")
    args = p.parse_args()
    common.CACHE.mkdir(parents=True, exist_ok=True)
    extra = ["--tiny"] if args.tiny else []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        peaks = Path(tmp) / "peaks.json"
        subprocess.run(
            [sys.executable, str(common.HERE / "peak.py"), "--out", str(peaks), *extra], check=True
        )
        import json

        pk = json.loads(peaks.read_text())
        common.append_row(
            args.results,
            "matmul peak",
            "2048 x 2048 F.linear, all threads",
            "GFLOP/s fp32 / bf16 (bf16 torch.mm)",
            f"{pk['fp32_gflops']:.0f} / {pk['bf16_gflops']:.1f} ({pk['bf16_mm_gflops']:.1f})",
        )
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
    if failed:
        raise SystemExit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
