"""Airflow DAG: the stages of every iteration (and the eval after the last) as tasks calling the CLI;
generate and score fanned out over `world_size` mapped tasks (one per rank).

Put this file in Airflow's dags folder. It has no logic of its own: the CLI skips completed
stages, so a retried or re-triggered task only does the missing work. Per iteration:
  eval (--if-due) -> generate x world_size -> score x world_size -> topup -> advantage -> train
With max_staleness S > 0 the iterations overlap as `run`'s two lanes do: generate K waits for
train K-1-S (the policy it samples from; nothing in the first S + 1 iterations) and for score K-1
(the sample lane, in order), not for train K-1; topup and advantage K wait for score K, eval K for
train K-1, and train K for advantage K and eval K, so Airflow runs the lanes concurrently by itself.
generate and score run as mapped tasks, `--rank r --world-size N` for r in 0..N-1 (dynamic task
mapping); each writes the parts of its rank and whichever finds every part commits the stage.
`topup` runs the dynamic-sampling rounds (advantage.min_groups) where `run` would, in one task.
With run_dir on S3 or GCS the tasks may run on different workers: give them the AWS_* (or
GOOGLE_APPLICATION_CREDENTIALS) environment. Configure with
  - params (per run, in the trigger form or `airflow dags test -c '{...}'`):
      config      the rlhf-batch TOML config file (absolute path)
      overrides   extra `--set key=value` arguments, e.g. "--set run_dir=s3://bucket/run7"
      world_size  the number of generate and score tasks per iteration (default 1)
  - Airflow Variables (read when the DAG file is parsed; AIRFLOW_VAR_<NAME> env vars work too):
      rlhf_batch_iterations  number of iterations (default 2)
      rlhf_batch_max_staleness  max_staleness S (default 0: lock-step); the DAG's shape depends on
                             it, so it is fixed when the file is parsed and every task passes it
                             to the CLI (`--set max_staleness=S`), overriding the config's
      rlhf_batch_bin         the rlhf-batch executable (default: `rlhf-batch` on PATH)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, Param, Variable, get_current_context, task

ITERATIONS = int(Variable.get("rlhf_batch_iterations", default="2"))
STALENESS = int(Variable.get("rlhf_batch_max_staleness", default="0"))
BIN = Variable.get("rlhf_batch_bin", default="rlhf-batch")
# rlhf_batch.stages.registry.pipeline(), tested equal; generate and score fan out
STAGES = ("eval", "generate", "score", "advantage", "train")
FANNED = ("generate", "score")
# eval runs where `run` would run it (iteration 0, every eval.every-th, and after the last, when
# [eval] prompts is set): its task always exists and `--if-due` makes it a no-op elsewhere.
DUE = f"--if-due --set iterations={ITERATIONS}"
# train: a decaying LR schedule's length is fixed by the first train as iterations x its steps
LENGTH = f"--set iterations={ITERATIONS}"
RANK = "--rank $RLHF_BATCH_RANK --world-size {{ params.world_size }}"
RETRY = {"retries": 1, "retry_delay": timedelta(minutes=1)}


def command(stage: str, it: int, extra: str = "") -> str:
    return (
        f"{BIN} {stage} {{{{ params.config }}}} --iter {it} --quiet --set max_staleness={STALENESS} "
        f"{extra} {{{{ params.overrides }}}}"
    )


@task
def ranks() -> list[dict[str, str]]:
    """One environment per rank: the mapped tasks' `RLHF_BATCH_RANK`."""
    world = int(get_current_context()["params"]["world_size"])
    return [{"RLHF_BATCH_RANK": str(r)} for r in range(world)]


with DAG(
    dag_id="rlhf_batch",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    params={
        "config": Param("pipelines/demo.toml", type="string"),
        "overrides": Param("", type="string"),
        "world_size": Param(1, type="integer", minimum=1),
    },
    tags=["rlhf-batch"],
) as dag:
    previous = fanout = ranks()
    tasks: dict[tuple[int, str], Any] = {}
    for it in range(ITERATIONS + 1):  # + 1: the eval of the last iteration's policy
        for stage in STAGES if it < ITERATIONS else STAGES[:1]:
            name = f"iter{it:04d}_{stage}"
            if stage in FANNED:  # append_env: the worker's environment (AWS_*, PATH) and the rank
                task_ = BashOperator.partial(
                    task_id=name, bash_command=command(stage, it, RANK), append_env=True, **RETRY
                ).expand(env=fanout)
            else:
                task_ = BashOperator(
                    task_id=name,
                    bash_command=command(stage, it, {"eval": DUE, "train": LENGTH}.get(stage, "")),
                    **RETRY,
                )
            if stage == "advantage":  # the dynamic-sampling rounds that `run` runs before it
                rounds = BashOperator(
                    task_id=f"iter{it:04d}_topup", bash_command=command("topup", it), **RETRY
                )
                previous >> rounds
                previous = rounds
            if STALENESS and stage == "generate":  # the sample lane: not after eval K (train K-1)
                previous = tasks.get((it - 1 - STALENESS, "train"), fanout)
                if it:
                    tasks[(it - 1, "score")] >> task_
            if STALENESS and stage == "eval":  # the learn lane: after train K-1
                previous = tasks.get((it - 1, "train"), fanout)
            if STALENESS and stage == "train":
                tasks[(it, "eval")] >> task_
            previous >> task_
            previous = tasks[(it, stage)] = task_
