"""The Airflow DAG, run for real by Apache Airflow (installed by `make airflow` in its own venv)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout, manifests

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW = ROOT / ".venv-airflow" / "bin" / "airflow"

pytestmark = pytest.mark.slow


def test_dag_runs_two_iterations_of_the_demo(tmp_path: Path) -> None:
    if not AIRFLOW.exists():
        pytest.skip("Apache Airflow is not installed: run `make airflow` (make test does)")
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "pipelines"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_VAR_RLHF_BATCH_ITERATIONS": "2",
        "AIRFLOW_VAR_RLHF_BATCH_BIN": str(Path(sys.executable).parent / "rlhf-batch"),
    }
    subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, check=True, capture_output=True)
    conf = {
        "config": str(ROOT / "pipelines" / "demo.toml"),
        "overrides": f"--set run_dir={run_dir} --set generate.prompts_per_part=128",
    }
    res = subprocess.run(
        [str(AIRFLOW), "dags", "test", "rlhf_batch", "-c", json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for it in (0, 1):
        for stage in ("rollouts", "scores", "advantages", "train"):
            m = manifests.manifest(layout.folder(run_dir, it, stage))
            assert m is not None, f"iteration {it} {stage} is not complete"
        rollouts = manifests.manifest(layout.folder(run_dir, it, "rollouts"))
        assert rollouts is not None and rollouts["rows"] == 64 * 8  # 64 prompts per iteration x G 8
        assert (layout.policy_dir(run_dir, it) / "config.json").exists()
    assert not layout.iter_dir(run_dir, 2).exists()  # exactly the two iterations the Variable asked for
    # iteration 1 sampled from iteration 0's policy
    assert rollouts["policy"] == str(layout.policy_dir(run_dir, 0))
