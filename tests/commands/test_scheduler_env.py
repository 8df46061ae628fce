"""Inside a multi-task Slurm allocation (`sbatch -N2`, `salloc -N2`: SLURM_PROCID=0 SLURM_NTASKS=2
in every process), an array task or an Indexed Job's pod, a command that did not ask for a fan-out
(`--world-size auto` or N) writes every part: `run`, whose stage processes inherit the variables,
and each stage command alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.store import layout, manifests
from tests.stages.cli_helpers import cli, manifest, stage

SLURM_TWO_TASKS = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}


def _config(make_config, demo_prompts: Path, with_eval: bool = True):  # noqa: ANN001, ANN202
    return make_config(
        iterations=1,
        threads=1,
        score={"rows_per_part": 20},
        train={"tokens_per_step": 256, "ppo_epochs": 1},
        eval={"prompts": str(demo_prompts) if with_eval else "", "n": 2, "k": [1]},
    )


@pytest.mark.slow
def test_run_inside_a_two_task_slurm_allocation_writes_the_whole_iteration(
    make_config, demo_prompts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in SLURM_TWO_TASKS.items():
        monkeypatch.setenv(k, v)
    path, cfg = _config(make_config, demo_prompts, with_eval=False)  # eval: the stage test below
    run_pipeline(path, [], quiet=True)  # each stage a process of its own, as `rlhf-batch run`
    # 12 prompts x 4 samples = 48 rollouts and scores (all of them, not rank 0's half)
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48
    assert manifest(cfg.run_dir, "scores")["rows"] == 48
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "train")) is not None


def test_each_fan_out_stage_inside_a_two_task_slurm_allocation_writes_every_part(
    make_config, demo_prompts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in SLURM_TWO_TASKS.items():
        monkeypatch.setenv(k, v)
    path, cfg = _config(make_config, demo_prompts)
    for name in ("generate", "score", "eval"):
        stage(path, name)
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48
    assert manifest(cfg.run_dir, "scores")["rows"] == 48
    assert [p["file"][:10] for p in manifest(cfg.run_dir, "scores")["parts"]] == ["part-00000"] * 3
    assert manifest(cfg.run_dir, "eval")["rows"] == 24


def test_world_size_auto_takes_the_slurm_tasks_rank(
    make_config, demo_prompts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # task 1 of an srun step (step 0): outside a step (the batch script) auto is refused
    for k, v in {**SLURM_TWO_TASKS, "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(k, v)
    path, cfg = _config(make_config, demo_prompts)
    res = cli("generate", path, "--quiet", "--world-size", "auto")
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]
    sdir = layout.folder(cfg.run_dir, 0, layout.ROLLOUTS)
    # 12 prompts in parts of 5: parts 0, 1, 2; rank 1 of 2 writes part 1 and leaves the commit
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(1, 1)]
    assert manifests.manifest(sdir) is None
