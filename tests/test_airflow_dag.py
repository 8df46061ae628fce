"""The Airflow DAG, run for real by Apache Airflow (installed by `make airflow` in its own venv)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout, manifests
from rlhf_batch.store.fs import run_path

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW = ROOT / ".venv-airflow" / "bin" / "airflow"

pytestmark = pytest.mark.slow


def airflow_env(tmp_path: Path, iterations: int, staleness: int, env: dict | None) -> dict[str, str]:
    """Airflow's environment (a fresh, migrated AIRFLOW_HOME), the DAG's Variables, `env` for the tasks."""
    if not AIRFLOW.exists():
        pytest.skip("Apache Airflow is not installed: run `make airflow` (make test does)")
    out = {
        **os.environ,
        **(env or {}),
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "pipelines"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_VAR_RLHF_BATCH_ITERATIONS": str(iterations),
        "AIRFLOW_VAR_RLHF_BATCH_MAX_STALENESS": str(staleness),
        "AIRFLOW_VAR_RLHF_BATCH_BIN": str(Path(sys.executable).parent / "rlhf-batch"),
    }
    subprocess.run([str(AIRFLOW), "db", "migrate"], env=out, check=True, capture_output=True)
    return out


def airflow_dags_test(
    tmp_path: Path, conf: dict, iterations: int, env: dict | None = None, staleness: int = 0
) -> None:
    """`airflow dags test rlhf_batch -c CONF` in a fresh AIRFLOW_HOME; the tasks get `env`."""
    env = airflow_env(tmp_path, iterations, staleness, env)
    res = subprocess.run(
        [str(AIRFLOW), "dags", "test", "rlhf_batch", "-c", json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_dag_runs_two_iterations_of_the_demo(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    conf = {
        "config": str(ROOT / "pipelines" / "demo.toml"),
        "overrides": f"--set run_dir={run_dir} --set generate.prompts_per_part=128",
    }
    airflow_dags_test(tmp_path, conf, 2)
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


def rows(run_dir: str) -> dict[str, list[dict]]:
    """Every row of every output folder (top-up rounds included) by its path under the run, sorted
    by rollout_id; the path of the policy that sampled (a local path or a URI) left out."""
    import pyarrow.parquet as pq

    out: dict[str, list[dict]] = {}
    root = run_path(run_dir)
    for part in root.glob("iter=*/**/part-*.parquet"):
        if part.parent.name not in ("rollouts", "scores", "advantages"):
            continue  # train's metrics hold timings
        t = pq.read_table(io.BytesIO(part.read_bytes()))
        folder = str(part.parent)[len(str(root)) :]
        out.setdefault(folder, []).extend(
            t.drop_columns([c for c in ("policy",) if c in t.column_names]).to_pylist()
        )
    return {k: sorted(v, key=lambda r: str(r.get("rollout_id"))) for k, v in out.items()}


def test_dag_fans_out_over_two_ranks_with_topup_rounds_on_s3(
    make_config, s3_run: str, s3_server, tmp_path: Path
) -> None:
    from rlhf_batch.commands.pipeline import run_pipeline
    from tests.store.test_s3_run import weights

    settings = {  # 13 informative groups of 12 prompts are never met: one top-up round per iteration
        "threads": 1,
        "score": {
            "reward_functions": ["tests.commands.test_topup:first_token_parity"],
            "kl_in_reward": False,
            "rows_per_part": 20,  # 48 rows in 3 parts, as the 12 prompts' rollouts are
        },
        "advantage": {"min_groups": 13, "max_topup_rounds": 1},
        "train": {"lr": 1e-3, "tokens_per_step": 256},
    }
    local, local_cfg = make_config(name="local.toml", iterations=2, in_process=True, **settings)
    remote, cfg = make_config(name="s3.toml", run_dir=s3_run, iterations=2, **settings)
    run_pipeline(local, [], quiet=True)
    tasks_env = {**s3_server.env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    airflow_dags_test(tmp_path, {"config": str(remote), "world_size": 2}, 2, tasks_env)
    for it in (0, 1):
        for folder in ("rollouts", "scores"):  # 3 parts each: rank 0 wrote 0 and 2, rank 1 part 1
            m = manifests.manifest(layout.folder(s3_run, it, folder))
            assert m is not None and m["rows"] == 48, (it, folder)
            expected = [layout.part_name(0, 0), layout.part_name(1, 1), layout.part_name(0, 2)]
            assert [p["file"] for p in m["parts"]] == expected
            assert [p.name for p in layout.list_parts(layout.folder(s3_run, it, folder))] == expected
            assert manifests.manifest(layout.folder(s3_run, it, folder, 1)) is not None  # the top-up round
        assert manifests.manifest(layout.folder(s3_run, it, "advantages"))["topup_rounds"] == [1]
        assert not layout.folder(s3_run, it, "rollouts", 2).exists()  # max_topup_rounds = 1
    assert not layout.iter_dir(s3_run, 2).exists()
    mine, ref = rows(s3_run), rows(local_cfg.run_dir)
    assert sorted(mine) == sorted(ref) and any("topup=01" in k for k in mine)
    for folder in ref:
        assert mine[folder] == ref[folder], folder
    for it in (0, 1):
        a, b = weights(s3_run, it), weights(local_cfg.run_dir, it)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


PARSE = """
import json
from airflow.dag_processing.dagbag import DagBag

bag = DagBag(dag_folder={path!r})
assert not bag.import_errors, bag.import_errors
dag = bag.get_dag("rlhf_batch")
print(json.dumps({{t.task_id: [sorted(t.upstream_task_ids),
                               getattr(t, "partial_kwargs", {{}}).get("bash_command") or t.bash_command]
                   for t in dag.tasks if t.task_id != "ranks"}}))
"""


def parsed_dag(tmp_path: Path, iterations: int, staleness: int) -> dict[str, tuple[list[str], str]]:
    """Task id -> (its upstream task ids, its command), as Airflow parses the DAG file."""
    env = airflow_env(tmp_path, iterations, staleness, None)
    code = PARSE.format(path=str(ROOT / "pipelines" / "airflow_dag.py"))
    res = subprocess.run(
        [str(AIRFLOW.parent / "python"), "-c", code], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return {k: (v[0], v[1]) for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def test_lock_step_dag_is_one_chain(tmp_path: Path) -> None:
    dag = parsed_dag(tmp_path, 2, 0)
    upstream = {k: v[0] for k, v in dag.items()}
    assert upstream == {  # the DAG of two lock-step iterations, written out
        "iter0000_eval": ["ranks"],
        "iter0000_generate": ["iter0000_eval", "ranks"],
        "iter0000_score": ["iter0000_generate", "ranks"],
        "iter0000_topup": ["iter0000_score"],
        "iter0000_advantage": ["iter0000_topup"],
        "iter0000_train": ["iter0000_advantage"],
        "iter0001_eval": ["iter0000_train"],
        "iter0001_generate": ["iter0001_eval", "ranks"],
        "iter0001_score": ["iter0001_generate", "ranks"],
        "iter0001_topup": ["iter0001_score"],
        "iter0001_advantage": ["iter0001_topup"],
        "iter0001_train": ["iter0001_advantage"],
        "iter0002_eval": ["iter0001_train"],
    }
    assert all("--set max_staleness=0 " in command for _, command in dag.values())


def ancestors(upstream: dict[str, list[str]], task: str) -> set[str]:
    seen: set[str] = set()
    todo = list(upstream.get(task, []))
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo += upstream.get(t, [])
    return seen


def test_dag_with_staleness_1_overlaps_the_lanes(tmp_path: Path) -> None:
    dag = parsed_dag(tmp_path, 4, 1)
    upstream = {k: v[0] for k, v in dag.items()}
    # generate K after train K-2 (none for K < 2) and after score K-1 (the sample lane in order)
    assert upstream["iter0000_generate"] == ["ranks"]
    assert upstream["iter0001_generate"] == ["iter0000_score", "ranks"]
    assert upstream["iter0002_generate"] == ["iter0000_train", "iter0001_score", "ranks"]
    assert upstream["iter0003_generate"] == ["iter0001_train", "iter0002_score", "ranks"]
    for k in range(4):
        assert f"iter{k - 1:04d}_train" not in ancestors(upstream, f"iter{k:04d}_generate")
        assert upstream[f"iter{k:04d}_score"] == [f"iter{k:04d}_generate", "ranks"]
        assert upstream[f"iter{k:04d}_topup"] == [f"iter{k:04d}_score"]
        assert upstream[f"iter{k:04d}_advantage"] == [f"iter{k:04d}_topup"]
        assert upstream[f"iter{k:04d}_train"] == [f"iter{k:04d}_advantage", f"iter{k:04d}_eval"]
        assert upstream[f"iter{k:04d}_eval"] == ([f"iter{k - 1:04d}_train"] if k else ["ranks"])
    assert upstream["iter0004_eval"] == ["iter0003_train"]
    # every task runs the stage with the DAG's staleness, whatever the config says
    assert all("--set max_staleness=1 " in command for _, command in dag.values())


def test_dag_with_staleness_1_runs_as_run_does(make_config, tmp_path: Path) -> None:
    """Airflow's run of the overlapped DAG holds the rows and weights of `run`'s with the same S."""
    from rlhf_batch.commands.pipeline import run_pipeline
    from tests.store.test_s3_run import weights

    settings = {"threads": 1, "train": {"lr": 1e-3, "tokens_per_step": 256}}
    local, local_cfg = make_config(name="local.toml", iterations=3, in_process=True, **settings)
    airflow, cfg = make_config(
        name="airflow.toml", run_dir=str(tmp_path / "airflow_run"), iterations=3, **settings
    )
    run_pipeline(local, ["max_staleness=1"], quiet=True)
    tasks_env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    airflow_dags_test(tmp_path, {"config": str(airflow)}, 3, tasks_env, staleness=1)
    for it in range(3):
        for stage in ("rollouts", "scores", "advantages", "train"):
            assert manifests.manifest(layout.folder(cfg.run_dir, it, stage)) is not None, (it, stage)
    assert not layout.iter_dir(cfg.run_dir, 3).exists()
    policy = [manifests.manifest(layout.folder(cfg.run_dir, it, "rollouts"))["policy"] for it in range(3)]
    # iteration K samples from iteration K-2's policy: 0 and 1 from the initial model, 2 from 0's
    assert policy[0] == policy[1] != str(layout.policy_dir(cfg.run_dir, 0))
    assert policy[2] == str(layout.policy_dir(cfg.run_dir, 0))
    mine, ref = rows(cfg.run_dir), rows(local_cfg.run_dir)
    assert sorted(mine) == sorted(ref)
    for folder in ref:
        assert mine[folder] == ref[folder], folder
    for it in range(3):
        a, b = weights(cfg.run_dir, it), weights(local_cfg.run_dir, it)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
