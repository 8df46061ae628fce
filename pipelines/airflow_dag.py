"""Airflow DAGs, one per experiment: the stages of every iteration (and the eval after the last)
as tasks calling the CLI; generate and score fanned out over `world_size` mapped tasks (one per
rank), train run by torchrun over `train_nproc` processes.

Put this file in Airflow's dags folder, beside an importable rlhf_batch (the DAG file reads its
staleness rule, rlhf_batch.core.staleness, which needs nothing but Python). It has no logic of
its own: the CLI skips completed stages, so a retried or re-triggered task only does the missing
work. Per iteration:
  eval (--if-due) -> generate x world_size -> score x world_size -> topup -> advantage -> train
With max_staleness S > 0 the iterations overlap as `run`'s two lanes do: generate K waits for
the train that wrote the policy it samples from (train K-1-S, none in the first S + 1
iterations: core.staleness.sampling_start) and for score K-1 (the sample lane, in order), not for
train K-1; topup and advantage K wait for score K, eval K for train K-1, and train K for
advantage K and eval K, so Airflow runs the lanes concurrently by itself. generate and score run
as mapped tasks, `--rank r --world-size N` for r in 0..N-1 (dynamic task mapping); each writes
the parts of its rank and whichever finds every part commits the stage. `topup` runs the
dynamic-sampling rounds (advantage.min_groups) where `run` would, in one task. With run_dir on
S3 or GCS the tasks may run on different workers: give them the AWS_* (or
GOOGLE_APPLICATION_CREDENTIALS) environment.

Experiments: the Airflow Variable `rlhf_batch_experiments` (AIRFLOW_VAR_RLHF_BATCH_EXPERIMENTS
works too), a JSON object {"NAME": {"config": "/abs/path.toml", ...}, ...}, read when the file is
parsed; each NAME becomes the DAG `rlhf_batch_NAME` (build_dag). Keys of an experiment:
  config          the rlhf-batch TOML config file (absolute path; required)
  iterations      number of iterations (default: the config file's `iterations`, else 1)
  max_staleness   S (default: the config file's `max_staleness`, else 0); the DAG's shape
                  depends on it, so every task passes `--set max_staleness=S` to the CLI
  overrides       default of the `overrides` param, e.g. "--set run_dir=s3://bucket/run7"
  world_size      default of the `world_size` param (generate and score tasks per iteration)
  train_nproc     default of the `train_nproc` param (train's torchrun processes on its worker)
  queue, pool     {"STAGE": name} for STAGE in eval, generate, score, topup, advantage, train:
                  the Celery queue / Airflow pool of that stage's tasks (e.g. GPU stages to GPU
                  workers); a stage not named keeps Airflow's default queue and pool
  timeout_minutes {"STAGE": minutes}: each task's execution_timeout (defaults: TIMEOUT_MINUTES)
  bin, torchrun   the rlhf-batch and torchrun executables (default: the Variable
                  `rlhf_batch_bin`, else `rlhf-batch` on PATH; torchrun beside it)
Without that Variable the file makes one DAG, `rlhf_batch`, from the Variables
rlhf_batch_iterations (default 2) and rlhf_batch_max_staleness (default 0), its config a param.
Params of every DAG (per run, in the trigger form or `airflow dags test -c '{...}'`): config,
overrides, world_size, train_nproc.
"""

from __future__ import annotations

import json
import os
import shlex
import tomllib
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, Param, Variable, get_current_context, task

from rlhf_batch.core.staleness import sampling_start

# rlhf_batch.stages.registry.pipeline(), tested equal; generate and score fan out
STAGES = ("eval", "generate", "score", "advantage", "train")
FANNED = ("generate", "score")
KINDS = (*STAGES, "topup")
TIMEOUT_MINUTES = {"eval": 120, "generate": 360, "score": 360, "topup": 360, "advantage": 60, "train": 720}
KEYS = {"config", "iterations", "max_staleness", "overrides", "world_size", "train_nproc"}
KEYS |= {"queue", "pool", "timeout_minutes", "bin", "torchrun"}
RANK = "--rank $RLHF_BATCH_RANK --world-size {{ params.world_size }}"


@task(execution_timeout=timedelta(minutes=5))
def ranks() -> list[dict[str, str]]:
    """One environment per rank: the mapped tasks' `RLHF_BATCH_RANK`."""
    world = int(get_current_context()["params"]["world_size"])
    return [{"RLHF_BATCH_RANK": str(r)} for r in range(world)]


def from_config(config: str, key: str, default: int) -> int:
    """A top-level integer of the config file (when it is a readable local file), else `default`."""
    try:
        with open(config, "rb") as f:
            return int(tomllib.load(f).get(key, default))
    except OSError:
        return default


def stage_args(spec: dict[str, Any], kind: str) -> dict[str, Any]:
    """The operator arguments of a stage kind's tasks: retries, timeout, queue and pool."""
    minutes = {**TIMEOUT_MINUTES, **spec.get("timeout_minutes", {})}[kind]
    out: dict[str, Any] = {"retries": 1, "retry_delay": timedelta(minutes=1)}
    out["execution_timeout"] = timedelta(minutes=minutes)
    for key in ("queue", "pool"):
        if kind in spec.get(key, {}):
            out[key] = spec[key][kind]
    return out


def check(name: str, spec: dict[str, Any]) -> None:
    """A wrong experiment fails the DAG file's import with a message naming the key."""
    if not isinstance(spec, dict) or "config" not in spec:
        raise ValueError(f"rlhf_batch_experiments[{name!r}]: an object with a 'config' path")
    for key in sorted(set(spec) - KEYS):
        raise ValueError(f"rlhf_batch_experiments[{name!r}]: unknown key {key!r} (known: {sorted(KEYS)})")
    for key in ("queue", "pool", "timeout_minutes"):
        for kind in sorted(set(spec.get(key, {})) - set(KINDS)):
            raise ValueError(f"rlhf_batch_experiments[{name!r}].{key}: unknown stage {kind!r}")


def sh_words(text: str) -> str:
    """The options of `overrides`, split as a shell would and each quoted: nothing in them runs."""
    return " ".join(shlex.quote(w) for w in shlex.split(text or ""))


FILTERS = {"sh": shlex.quote, "sh_words": sh_words}  # Jinja filters of the bash commands


def build_dag(dag_id: str, spec: dict[str, Any]) -> DAG:
    """The DAG of one experiment (`spec`: the keys in this file's docstring)."""
    check(dag_id, spec)
    iterations = int(spec.get("iterations", from_config(spec["config"], "iterations", 1)))
    stale = int(spec.get("max_staleness", from_config(spec["config"], "max_staleness", 0)))
    exe = spec.get("bin", "rlhf-batch")
    torchrun = spec.get("torchrun", os.path.join(os.path.dirname(exe), "torchrun"))
    launch = {  # train: torchrun over train_nproc processes (one process without it when 1)
        "train": f"{{% if params.train_nproc > 1 %}}{torchrun} --standalone --nproc-per-node "
        f"{{{{ params.train_nproc }}}} -m rlhf_batch{{% else %}}{exe}{{% endif %}}"
    }
    extra = {  # eval where `run` would; a decaying LR schedule's length is fixed by the first train
        "eval": f"--if-due --set iterations={iterations}",
        "train": f"--set iterations={iterations}",
    }

    def command(stage: str, it: int, more: str = "") -> str:
        # the params quoted for bash (FILTERS); the overrides first: the DAG's fixed settings win
        return (
            f"{launch.get(stage, exe)} {stage} {{{{ params.config | sh }}}} --iter {it} --quiet "
            f"{{{{ params.overrides | sh_words }}}} --set max_staleness={stale} {more or extra.get(stage, '')}"
        )

    params = {
        "config": Param(spec["config"], type="string"),
        "overrides": Param(spec.get("overrides", ""), type="string"),
        "world_size": Param(int(spec.get("world_size", 1)), type="integer", minimum=1),
        "train_nproc": Param(int(spec.get("train_nproc", 1)), type="integer", minimum=1),
    }
    with DAG(
        dag_id=dag_id,
        schedule=None,
        catchup=False,
        max_active_runs=1,
        params=params,
        tags=["rlhf-batch"],
        user_defined_filters=FILTERS,
    ) as dag:
        fanout = ranks()
        chain(fanout, iterations, stale, command, lambda kind: stage_args(spec, kind))
    return dag


def chain(fanout: Any, iterations: int, stale: int, command: Any, args: Any) -> None:
    """The tasks of `iterations` iterations (and the last eval) and their dependencies."""
    previous = fanout
    tasks: dict[tuple[int, str], Any] = {}
    for it in range(iterations + 1):  # + 1: the eval of the last iteration's policy
        for stage in STAGES if it < iterations else STAGES[:1]:
            name = f"iter{it:04d}_{stage}"
            if stage in FANNED:  # append_env: the worker's environment (AWS_*, PATH) and the rank
                task_ = BashOperator.partial(
                    task_id=name, bash_command=command(stage, it, RANK), append_env=True, **args(stage)
                ).expand(env=fanout)
            else:
                task_ = BashOperator(task_id=name, bash_command=command(stage, it), **args(stage))
            if stage == "advantage":  # the dynamic-sampling rounds that `run` runs before it
                rounds = BashOperator(
                    task_id=f"iter{it:04d}_topup", bash_command=command("topup", it), **args("topup")
                )
                previous >> rounds
                if stale and it:  # the learn lane in order: each takes the run's lock, as train does
                    tasks[(it - 1, "train")] >> rounds
                previous = rounds
            if stale and stage == "generate":  # the sample lane: after the train of its policy
                previous = tasks.get((sampling_start(it, stale) - 1, "train"), fanout)
                if it:
                    tasks[(it - 1, "score")] >> task_
            if stale and stage == "eval":  # the learn lane: after train K-1
                previous = tasks.get((it - 1, "train"), fanout)
            if stale and stage == "train":
                tasks[(it, "eval")] >> task_
            previous >> task_
            previous = tasks[(it, stage)] = task_


def experiments() -> dict[str, dict[str, Any]]:
    """dag_id -> experiment, from the Variables (see the docstring)."""
    bin_ = Variable.get("rlhf_batch_bin", default="rlhf-batch")
    raw = Variable.get("rlhf_batch_experiments", default="")
    if raw:
        return {f"rlhf_batch_{name}": {"bin": bin_, **spec} for name, spec in json.loads(raw).items()}
    legacy = {
        "config": "pipelines/demo.toml",
        "iterations": int(Variable.get("rlhf_batch_iterations", default="2")),
        "max_staleness": int(Variable.get("rlhf_batch_max_staleness", default="0")),
    }
    return {"rlhf_batch": {"bin": bin_, **legacy}}


for _dag_id, _spec in experiments().items():
    globals()[_dag_id] = build_dag(_dag_id, _spec)
