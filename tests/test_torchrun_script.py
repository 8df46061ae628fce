"""pipelines/torchrun_multi_gpu.sh run as a user runs it, with 2 processes on the CPU (gloo):
one iteration of every stage, `--set` passed through to each command."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout, manifests

SCRIPT = Path(__file__).resolve().parents[1] / "pipelines" / "torchrun_multi_gpu.sh"

pytestmark = pytest.mark.slow


def test_script_runs_one_iteration_on_two_processes(make_config, tmp_path: Path) -> None:
    path, cfg = make_config(score={"rows_per_part": 10})  # 48 rows: 5 scores parts, 3 rollouts parts
    run_dir = tmp_path / "elsewhere"  # only via --set: proves the overrides reach every command
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    args = [str(path), "2", "1", "--set", f"run_dir={run_dir}", "--set", "train.ppo_epochs=1"]
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not Path(cfg.run_dir).exists()
    for stage in ("rollouts", "scores", "advantages", "train"):
        m = manifests.manifest(layout.folder(run_dir, 0, stage))
        assert m is not None, f"{stage} is not complete"
        if stage in ("rollouts", "scores"):  # written by both ranks: part-00000-* and part-00001-*
            assert {p["file"][5:10] for p in m["parts"]} == {"00000", "00001"}, stage
    rollouts = manifests.manifest(layout.folder(run_dir, 0, "rollouts"))
    assert rollouts is not None and rollouts["rows"] == 12 * 4  # 12 prompts x G = 4
    assert (layout.policy_dir(run_dir, 0) / "model.safetensors").exists()
    assert not layout.iter_dir(run_dir, 1).exists()  # ITERATIONS = 1
