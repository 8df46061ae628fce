from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def make_target(
    cwd: Path, target: str, *variables: str, timeout: int = 900
) -> subprocess.CompletedProcess[str]:
    """`make TARGET` of the repository's Makefile, its recipe exactly as written (relative paths
    and all), run from `cwd`: a stand-in for the repository root holding links to the Makefile and
    benchmarks/, so what the recipe writes (gpu_check/, gpu_bench/) lands in `cwd`."""
    root = Path(__file__).resolve().parents[2]
    for name in ("Makefile", "benchmarks"):
        (cwd / name).symlink_to(root / name)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = ["make", "--no-print-directory", target, f"PYTHON={sys.executable}", *variables]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
