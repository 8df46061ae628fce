"""Kill `rlhf-batch run` with SIGKILL at named points of every stage, run it again, and compare
with the uninterrupted reference run: the same rows, rewards, advantages and weights.

Each chain is a sequence of kills in one run directory (every re-run resumes the previous one
and is killed again further on), then a re-run to the end. A point name fires at its first
occurrence, so a name repeated after the iteration-0 points fires in iteration 1. A point that a
run never reaches fails the test (the process must die with -9).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlhf_batch.store import layout, manifests
from tests.reliability.harness import (
    KILLS,
    Assets,
    alive,
    assert_same_as_reference,
    children,
    command,
    environment,
    run,
    run_killed_at,
    run_to_completion,
    wait_for,
)

# Per stage at least: model load (advantage: its DuckDB pool built; score loads no model, the demo
# uses no KL), mid-write of a part (between the temporary file and its rename, or just after the
# rename), between the last part and the manifest; then points of iteration 1.
CHAINS = {
    "generate+score": [
        "rollouts:model-loaded",
        "rollouts:part-1:tmp",
        "rollouts:part-2:done",
        "rollouts:manifest",
        "scores:part-0:tmp",
        "scores:part-1:done",
        "scores:manifest",
        "rollouts:part-0:tmp",
        "scores:part-0:done",
        "scores:part-2:tmp",  # iteration 1
    ],
    "advantage+train": [
        "advantages:pool",
        "advantages:part-1:tmp",
        "advantages:part-2:done",
        "advantages:manifest",
        "train:model-loaded",
        "train:checkpoint-2",
        "train:policy:tmp",
        "train:manifest",
        "train:manifest:done",
        "advantages:part-0:done",
        "train:checkpoint-2",  # iteration 1
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("chain", list(CHAINS))
def test_killed_in_process_run_resumes_to_the_reference_result(
    chain: str, assets: Assets, reference: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    for point in CHAINS[chain]:
        run_killed_at(assets, run_dir, point)
    run_to_completion(assets, run_dir)
    assert_same_as_reference(run_dir, reference)


def kill_run_during_generate(assets: Assets, run_dir: Path) -> None:
    """SIGKILL to `run` alone, as a scheduler sends it, while its generate process works: the stage
    process must die with it, not write on behind the released lock next to the re-run's."""
    proc = subprocess.Popen(
        command(assets, run_dir, "--set", "in_process=false", iterations=1),
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: (layout.folder(run_dir, 0, "rollouts") / layout.STARTED).exists())
    stages = children(proc.pid)
    assert stages, "no stage process"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    KILLS["named"] += 1
    wait_for(lambda: not any(alive(c) for c in stages), timeout=10)
    time.sleep(1.0)
    assert (
        manifests.manifest(layout.folder(run_dir, 0, "rollouts")) is None
    )  # nothing finished behind our back


@pytest.mark.slow
@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="reads a process's children from Linux /proc"
)
def test_killed_stage_processes_resume_to_the_reference_result(
    assets: Assets, reference: Path, tmp_path: Path
) -> None:
    """The default mode, one process per stage: `run` killed, then a fault killing the stage process
    (`run` reports it and exits 1) at a point of each later stage; a re-run completes."""
    run_dir = tmp_path / "run"
    kill_run_during_generate(assets, run_dir)
    for point in ("scores:manifest", "advantages:part-0:done", "train:policy:tmp"):
        res = run(assets, run_dir, "--set", "in_process=false", fault=point, iterations=1)
        assert res.returncode == 1, f"{point}: not reached\n{res.stderr[-2000:]}"
        assert f"failed (exit {-signal.SIGKILL})" in res.stderr.strip().splitlines()[-1]
        KILLS["named"] += 1
    run_to_completion(assets, run_dir, "--set", "in_process=false", iterations=1)
    assert_same_as_reference(run_dir, reference, iterations=1)
