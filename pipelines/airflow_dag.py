"""Airflow DAG: one task per stage per iteration, each calling the `rlhf-batch` CLI.

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
STAGES = ("generate", "score", "advantage", "train")  # rlhf_batch.stages.registry.pipeline(), tested equal

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
    for it in range(ITERATIONS):
        for stage in STAGES:
            task = BashOperator(
                task_id=f"iter{it:04d}_{stage}",
                bash_command=f"{BIN} {stage} {{{{ params.config }}}} --iter {it} --quiet {{{{ params.overrides }}}}",
                retries=1,
                retry_delay=timedelta(minutes=1),
            )
            if previous is not None:
                previous >> task
            previous = task
