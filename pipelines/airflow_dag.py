"""Airflow DAG: one task per stage per iteration (and the eval after the last), each calling the CLI.

Put this file in Airflow's dags folder. It has no logic of its own: the CLI skips completed
stages, so a retried or re-triggered task only does the missing work. Configure with
  - params (per run, in the trigger form or `airflow dags test -c '{...}'`):
      config     the rlhf-batch TOML config file (absolute path)
      overrides  extra `--set key=value` arguments, e.g. "--set run_dir=/data/run7"
  - Airflow Variables (read when the DAG file is parsed; AIRFLOW_VAR_<NAME> env vars work too):
      rlhf_batch_iterations  number of iterations (default 2)
      rlhf_batch_bin         the rlhf-batch executable (default: `rlhf-batch` on PATH)
"""

from __future__ import annotations

from datetime import timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, Param, Variable

ITERATIONS = int(Variable.get("rlhf_batch_iterations", default="2"))
BIN = Variable.get("rlhf_batch_bin", default="rlhf-batch")
# rlhf_batch.stages.registry.pipeline(), tested equal
STAGES = ("eval", "generate", "score", "advantage", "train")
# eval runs where `run` would run it (iteration 0, every eval.every-th, and after the last, when
# [eval] prompts is set): its task always exists and `--if-due` makes it a no-op elsewhere.
DUE = f"--if-due --set iterations={ITERATIONS}"

with DAG(
    dag_id="rlhf_batch",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    params={
        "config": Param("pipelines/demo.toml", type="string"),
        "overrides": Param("", type="string"),
    },
    tags=["rlhf-batch"],
) as dag:
    previous = None
    for it in range(ITERATIONS + 1):  # + 1: the eval of the last iteration's policy
        for stage in STAGES if it < ITERATIONS else STAGES[:1]:
            extra = DUE if stage == "eval" else ""
            task = BashOperator(
                task_id=f"iter{it:04d}_{stage}",
                bash_command=f"{BIN} {stage} {{{{ params.config }}}} --iter {it} --quiet {extra} {{{{ params.overrides }}}}",
                retries=1,
                retry_delay=timedelta(minutes=1),
            )
            if previous is not None:
                previous >> task
            previous = task
