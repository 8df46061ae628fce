"""The Airflow DAGs, as the real Apache Airflow (installed by `make airflow` in its own venv) parses
them (one DagBag run for the whole module: the DAG factory's experiments, the one-DAG form, a
wrong experiment) and runs one of them end to end (`airflow dags test`)."""

import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout, manifests
from rlhf_batch.store.fs import run_path

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW = ROOT / ".venv-airflow" / "bin" / "airflow"
DAG_FILE = ROOT / "pipelines" / "airflow_dag.py"
BIN = str(Path(sys.executable).parent / "rlhf-batch")

pytestmark = pytest.mark.slow  # Airflow is in its own venv, which `make test` builds


def airflow_env(tmp_path: Path, variables: dict[str, str], migrate: bool) -> dict[str, str]:
    """Airflow's environment: a fresh AIRFLOW_HOME (migrated when `migrate`), the DAG file's
    Variables, rlhf_batch importable (the DAG file reads core.staleness)."""
    if not AIRFLOW.exists():
        pytest.skip("Apache Airflow is not installed: run `make airflow` (make test does)")
    out = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAG_FILE.parent),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_VAR_RLHF_BATCH_BIN": BIN,
        **{f"AIRFLOW_VAR_{k.upper()}": v for k, v in variables.items()},
    }
    if migrate:
        subprocess.run([str(AIRFLOW), "db", "migrate"], env=out, check=True, capture_output=True)
    return out


# One DagBag per set of Variables (the DAG file reads them when it is parsed); every task's
# upstream ids, command, queue, pool, timeout and retries, every DAG's param defaults.
PARSE = """
import json, os, sys
from airflow.dag_processing.dagbag import DagBag

out = []
for variables in json.loads(sys.argv[1]):
    for k, v in variables.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    bag = DagBag(dag_folder={path!r})
    dags = {{}}
    for dag_id, dag in bag.dags.items():
        tasks = {{}}
        for t in dag.tasks:
            partial = getattr(t, "partial_kwargs", {{}})
            tasks[t.task_id] = {{
                "upstream": sorted(t.upstream_task_ids),
                "command": partial.get("bash_command") or getattr(t, "bash_command", None),
                "mapped": bool(partial),
                "queue": t.queue, "pool": t.pool, "retries": t.retries,
                "timeout": t.execution_timeout.total_seconds(),
            }}
        dags[dag_id] = {{"params": {{k: dag.params[k] for k in dag.params}}, "tasks": tasks}}
    out.append({{"errors": [str(e) for e in bag.import_errors.values()], "dags": dags}})
print(json.dumps(out))
"""

EXPERIMENTS = {
    "lockstep": {"config": "/nonexistent/run.toml", "iterations": 2},  # S: 0 (no file to read)
    "stale": {"config": "/nonexistent/run.toml", "iterations": 4, "max_staleness": 1},
    "cluster": {  # iterations and max_staleness from the config file (written by the fixture)
        "config": "CLUSTER",
        "overrides": "--set run_dir=s3://b/r",
        "world_size": 3,
        "train_nproc": 4,
        "queue": {"eval": "gpu", "generate": "gpu", "score": "gpu", "train": "gpu"},
        "pool": {"train": "trainers"},
        "timeout_minutes": {"train": 30},
        "bin": "/opt/venv/bin/rlhf-batch",
    },
}


@pytest.fixture(scope="module")
def parsed(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Three parses in one process: the experiments above, the one-DAG form (Variables
    rlhf_batch_iterations 2, no rlhf_batch_experiments) and an experiment with a wrong key."""
    tmp_path = tmp_path_factory.mktemp("airflow_parse")
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("iterations = 1\nmax_staleness = 1\n")
    experiments = json.loads(json.dumps(EXPERIMENTS).replace("CLUSTER", str(cluster)))
    var = "AIRFLOW_VAR_RLHF_BATCH_EXPERIMENTS"
    runs = [
        {var: json.dumps(experiments)},
        {var: None, "AIRFLOW_VAR_RLHF_BATCH_ITERATIONS": "2", "AIRFLOW_VAR_RLHF_BATCH_MAX_STALENESS": "0"},
        {var: json.dumps({"bad": {"config": "/a.toml", "queues": {"train": "gpu"}}})},
    ]
    env = airflow_env(tmp_path, {}, migrate=False)
    code = PARSE.format(path=str(DAG_FILE))
    res = subprocess.run(
        [str(AIRFLOW.parent / "python"), "-c", code, json.dumps(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def upstreams(dag: dict) -> dict[str, list[str]]:
    return {k: v["upstream"] for k, v in dag["tasks"].items() if k != "ranks"}


LOCK_STEP = {  # the DAG of two lock-step iterations, written out
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


def test_one_dag_per_experiment(parsed: list[dict]) -> None:
    experiments, _, _ = parsed
    assert experiments["errors"] == []
    assert sorted(experiments["dags"]) == ["rlhf_batch_cluster", "rlhf_batch_lockstep", "rlhf_batch_stale"]
    params = experiments["dags"]["rlhf_batch_lockstep"]["params"]
    assert params == {"config": "/nonexistent/run.toml", "overrides": "", "world_size": 1, "train_nproc": 1}


def test_lock_step_dag_is_one_chain(parsed: list[dict]) -> None:
    dag = parsed[0]["dags"]["rlhf_batch_lockstep"]
    assert upstreams(dag) == LOCK_STEP
    commands = [t["command"] for k, t in dag["tasks"].items() if k != "ranks"]
    assert all("--set max_staleness=0 " in c for c in commands)
    # the Variable's executable; train's through torchrun when train_nproc > 1 (below)
    assert all(c.startswith(f"{BIN} ") or f"{{% else %}}{BIN}{{% endif %}} train " in c for c in commands)
    assert all(t["mapped"] == ("generate" in k or "score" in k) for k, t in dag["tasks"].items())


def test_without_experiments_one_dag_from_the_variables(parsed: list[dict]) -> None:
    _, legacy, _ = parsed
    assert legacy["errors"] == [] and sorted(legacy["dags"]) == ["rlhf_batch"]
    dag = legacy["dags"]["rlhf_batch"]
    assert upstreams(dag) == LOCK_STEP
    assert dag["params"]["config"] == "pipelines/demo.toml"
    lock = parsed[0]["dags"]["rlhf_batch_lockstep"]["tasks"]
    assert {k: t["command"] for k, t in dag["tasks"].items()} == {k: t["command"] for k, t in lock.items()}


def test_a_wrong_experiment_key_is_an_import_error_naming_it(parsed: list[dict]) -> None:
    _, _, bad = parsed
    assert bad["dags"] == {}
    assert len(bad["errors"]) == 1 and "rlhf_batch_bad" in bad["errors"][0]
    assert "unknown key 'queues'" in bad["errors"][0]


def ancestors(upstream: dict[str, list[str]], task: str) -> set[str]:
    seen: set[str] = set()
    todo = list(upstream.get(task, []))
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo += upstream.get(t, [])
    return seen


def test_dag_with_staleness_1_overlaps_the_lanes(parsed: list[dict]) -> None:
    dag = parsed[0]["dags"]["rlhf_batch_stale"]
    upstream = upstreams(dag)
    # generate K after train K-2 (none for K < 2) and after score K-1 (the sample lane in order)
    assert upstream["iter0000_generate"] == ["ranks"]
    assert upstream["iter0001_generate"] == ["iter0000_score", "ranks"]
    assert upstream["iter0002_generate"] == ["iter0000_train", "iter0001_score", "ranks"]
    assert upstream["iter0003_generate"] == ["iter0001_train", "iter0002_score", "ranks"]
    for k in range(4):
        assert f"iter{k - 1:04d}_train" not in ancestors(upstream, f"iter{k:04d}_generate")
        assert upstream[f"iter{k:04d}_score"] == [f"iter{k:04d}_generate", "ranks"]
        # the learn lane in order: topup K after train K-1 (both take the run's lock)
        assert upstream[f"iter{k:04d}_topup"] == sorted(
            [f"iter{k:04d}_score"] + ([f"iter{k - 1:04d}_train"] if k else [])
        )
        assert upstream[f"iter{k:04d}_advantage"] == [f"iter{k:04d}_topup"]
        assert upstream[f"iter{k:04d}_train"] == [f"iter{k:04d}_advantage", f"iter{k:04d}_eval"]
        assert upstream[f"iter{k:04d}_eval"] == ([f"iter{k - 1:04d}_train"] if k else ["ranks"])
    assert upstream["iter0004_eval"] == ["iter0003_train"]
    # every task runs the stage with the DAG's staleness, whatever the config says
    assert all("--set max_staleness=1 " in t["command"] for k, t in dag["tasks"].items() if k != "ranks")


def test_queues_pools_and_timeouts_per_stage(parsed: list[dict]) -> None:
    dag = parsed[0]["dags"]["rlhf_batch_cluster"]
    # the config file's iterations = 1 and max_staleness = 1
    assert sorted(upstreams(dag)) == sorted(
        [f"iter0000_{s}" for s in ("eval", "generate", "score", "topup", "advantage", "train")]
        + ["iter0001_eval"]
    )
    assert upstreams(dag)["iter0000_train"] == ["iter0000_advantage", "iter0000_eval"]
    got = {k: (t["queue"], t["pool"], t["timeout"], t["retries"]) for k, t in dag["tasks"].items()}
    hour = 3600.0
    assert got == {
        "ranks": ("default", "default_pool", 300.0, 0),
        "iter0000_eval": ("gpu", "default_pool", 2 * hour, 1),
        "iter0000_generate": ("gpu", "default_pool", 6 * hour, 1),
        "iter0000_score": ("gpu", "default_pool", 6 * hour, 1),
        "iter0000_topup": ("default", "default_pool", 6 * hour, 1),
        "iter0000_advantage": ("default", "default_pool", 1 * hour, 1),
        "iter0000_train": ("gpu", "trainers", 0.5 * hour, 1),
        "iter0001_eval": ("gpu", "default_pool", 2 * hour, 1),
    }
    assert dag["params"] == {
        "config": EXPERIMENTS["cluster"]["config"].replace("CLUSTER", dag["params"]["config"]),
        "overrides": "--set run_dir=s3://b/r",
        "world_size": 3,
        "train_nproc": 4,
    }


def render_env():  # noqa: ANN201
    """Jinja with the DAG's filters (pipelines/airflow_dag.py FILTERS: shlex.quote, and each
    word of the overrides quoted), as Airflow renders the commands."""
    import jinja2

    env = jinja2.Environment()
    env.filters["sh"] = shlex.quote
    env.filters["sh_words"] = lambda text: " ".join(shlex.quote(w) for w in shlex.split(text or ""))
    return env


def test_params_are_quoted_and_cannot_override_the_dags_fixed_settings(parsed: list[dict], tmp_path) -> None:
    """A config path with a space and `$(...)` reaches the CLI as one word and runs nothing; an
    override of max_staleness in the trigger form loses to the DAG's (it decides the DAG's shape)."""
    from tests.test_schedulers import parse

    dag = parsed[0]["dags"]["rlhf_batch_stale"]
    marker = tmp_path / "ran"
    config = f"/runs/my run$(touch {marker}).toml"
    params = {
        **dag["params"],
        "config": config,
        "overrides": "--set 'run_dir=s3://b/a b' --set max_staleness=0",
    }
    line = render_env().from_string(dag["tasks"]["iter0001_advantage"]["command"]).render(params=params)
    res = subprocess.run(["bash", "-c", f"printf '%s\\n' {line}"], capture_output=True, text=True)
    words = res.stdout.splitlines()
    assert not marker.exists() and words[1:3] == ["advantage", config]
    ctx = parse(words[1:])
    assert ctx.params["set_"][:3] == ["run_dir=s3://b/a b", "max_staleness=0", "max_staleness=1"]


def test_train_runs_through_torchrun_with_train_nproc(parsed: list[dict]) -> None:
    from torch.distributed.run import get_args_parser

    from tests.test_schedulers import parse

    dag = parsed[0]["dags"]["rlhf_batch_cluster"]
    template = render_env().from_string(dag["tasks"]["iter0000_train"]["command"])
    for nproc in (4, 1):
        words = shlex.split(template.render(params={**dag["params"], "train_nproc": nproc}))
        if nproc == 1:  # one process: the CLI itself
            assert words[:2] == ["/opt/venv/bin/rlhf-batch", "train"]
            cli = words[1:]
        else:  # torchrun beside the rlhf-batch executable, -m rlhf_batch
            assert words[0] == "/opt/venv/bin/torchrun"
            args = get_args_parser().parse_args(words[1:])
            assert (args.standalone, args.nproc_per_node, args.module) == (True, "4", True)
            assert args.training_script == "rlhf_batch"
            cli = args.training_script_args
        ctx = parse(cli)
        assert (ctx.info_name, ctx.params["iteration"]) == ("train", 0)
        assert ctx.params["set_"] == ["run_dir=s3://b/r", "max_staleness=1", "iterations=1"]
    assert "torchrun" not in dag["tasks"]["iter0000_generate"]["command"]


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


def test_dag_runs_as_run_does_fanned_out_overlapped_on_s3_with_torchrun(
    make_config, s3_run: str, s3_server, tmp_path: Path
) -> None:
    """`airflow dags test` of an experiment: 2 iterations with max_staleness 1, generate and
    score over 2 ranks, one top-up round per iteration, train through torchrun with 2 processes,
    the run on the S3 server. Its rows equal a `run` on local disk with the same config; its
    policies too, to the 2-rank tolerance (2 ranks sum gradients in another order)."""
    from tests.store.test_s3_run import weights

    settings = {  # 13 informative groups of 12 prompts are never met: one top-up round per iteration
        "threads": 1,
        "max_staleness": 1,
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
    reference = subprocess.Popen(  # side by side with Airflow's run (its tasks run one at a time)
        [sys.executable, "-m", "rlhf_batch", "run", str(local), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "reference.err").open("w"),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    experiment = {"config": str(remote)}  # iterations and max_staleness: the config file's
    env = airflow_env(tmp_path, {"rlhf_batch_experiments": json.dumps({"e2e": experiment})}, True)
    env |= {**s3_server.env(), "OMP_NUM_THREADS": "1"}
    conf = {"world_size": 2, "train_nproc": 2, "overrides": "--set threads=1"}
    res = subprocess.run(
        [str(AIRFLOW), "dags", "test", "rlhf_batch_e2e", "-c", json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert reference.wait(timeout=1800) == 0, (tmp_path / "reference.err").read_text()[-3000:]
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
    assert not layout.iter_dir(s3_run, 2).exists()  # exactly the config's 2 iterations
    # S = 1: iteration 1 samples from the initial policy, not from iteration 0's
    policy = [manifests.manifest(layout.folder(s3_run, it, "rollouts"))["policy"] for it in (0, 1)]
    assert policy[0] == policy[1] != str(layout.policy_dir(s3_run, 0))
    mine, ref = rows(s3_run), rows(local_cfg.run_dir)
    assert sorted(mine) == sorted(ref) and any("topup=01" in k for k in mine)
    for folder in ref:
        assert mine[folder] == ref[folder], folder
    for it in (0, 1):
        a, b = weights(s3_run, it), weights(local_cfg.run_dir, it)
        assert a.keys() == b.keys()
        assert all(float((a[k] - b[k]).abs().max()) <= 1e-5 for k in a), it
