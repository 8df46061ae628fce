"""Nothing a kill leaves behind stays: a temporary directory of a killed optimizer-state write is
removed by the next run, and a SIGKILL of `run` during generate takes the stage's helper processes
(vLLM's EngineCore; here a plain helper started the same way, in the stage's process group) down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout
from tests.reliability.harness import KILLS, alive, environment, wait_for


def rb(*args: object, fault: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rlhf_batch", *map(str, args)]
    return subprocess.run(cmd, env=environment(fault), capture_output=True, text=True, timeout=600)


def temporaries(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*") if layout.is_tmp(p.name))


@pytest.mark.slow
def test_a_kill_during_the_optimizer_state_write_leaves_no_temporary_for_good(make_config) -> None:
    path, cfg = make_config(iterations=2, in_process=True, threads=1)
    run_dir = Path(cfg.run_dir)
    res = rb("run", path, "--quiet", fault="dir:optimizer:tmp")
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    KILLS["named"] += 1
    assert [t.split("/")[-1].startswith(".optimizer.") for t in temporaries(run_dir)] == [True]
    res = rb("run", path, "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    assert temporaries(run_dir) == []
    assert (layout.optimizer_dir(run_dir, 0) / "optimizer.safetensors").is_file()


# generate.python: an "interpreter" that starts a long-lived helper in the background (as vLLM
# starts its EngineCore), records its pid, then runs the stage
WRAPPER = """#!/bin/sh
sleep 600 &
echo $! > "{pidfile}"
exec "{python}" "$@"
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux /proc")
def test_sigkill_of_run_during_generate_kills_the_stages_helpers(make_config, tmp_path: Path) -> None:
    pidfile = tmp_path / "helper.pid"
    wrapper = tmp_path / "python-with-helper"
    wrapper.write_text(WRAPPER.format(pidfile=pidfile, python=sys.executable))
    wrapper.chmod(0o755)
    path, cfg = make_config(iterations=1, threads=1, generate={"python": str(wrapper)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_batch", "run", str(path), "--quiet"],
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (layout.folder(cfg.run_dir, 0, "rollouts") / layout.STARTED).exists())
        helper = int(pidfile.read_text())
        assert alive(helper)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        KILLS["named"] += 1
        wait_for(lambda: not alive(helper), timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pidfile.exists() and alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
