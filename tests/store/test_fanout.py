"""Fan-out without a process group: independent processes, each with its own working directory and
model cache ("machines"), share one run on a real S3-protocol server (moto, on 127.0.0.1) and
write the parts of their rank; whichever finds every part there commits the manifest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.errors import UserError
from rlhf_batch.runtime.dist import fanout_from
from rlhf_batch.store import layout, manifests
from tests.store.test_s3_run import rows


def test_ranks_from_the_options_and_the_schedulers_environment() -> None:
    assert fanout_from(None, None, {}) is None
    assert fanout_from(2, 3, {}) == (2, 3)
    assert fanout_from(2, "3", {}) == (2, 3)  # --world-size reaches us as text
    # a Slurm array --array=4-6: task ids 4, 5, 6 are ranks 0, 1, 2
    slurm = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert fanout_from(None, "auto", slurm) == (1, 3)
    assert fanout_from(None, "auto", {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}) == (
        1,
        2,
    )
    # the batch script of a 2-task job (no srun step): it alone would write half the parts
    for batch in ({}, {"SLURM_STEP_ID": "4294967294"}):
        with pytest.raises(UserError, match="SLURM_NTASKS=2 but this process is the job's batch script"):
            fanout_from(None, "auto", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **batch})
    assert fanout_from(None, "auto", {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (0, 1)
    # srun launching torchrun: torchrun's ranks (its process group), not Slurm's
    torchrun = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}
    assert fanout_from(None, "auto", torchrun) is None
    k8s = {"JOB_COMPLETION_INDEX": "3", "RLHF_BATCH_WORLD_SIZE": "4"}
    assert fanout_from(None, "auto", k8s) == (3, 4)
    assert fanout_from(None, 4, {"JOB_COMPLETION_INDEX": "0"}) == (0, 4)  # the rank from the index
    with pytest.raises(UserError, match="JOB_COMPLETION_INDEX is set: give the world size once"):
        fanout_from(None, "auto", {"JOB_COMPLETION_INDEX": "3"})
    with pytest.raises(UserError, match="--rank 3 --world-size 3: the rank must be in 0..world size - 1"):
        fanout_from(3, 3, {})
    with pytest.raises(UserError, match="go together"):
        fanout_from(1, None, {})
    with pytest.raises(UserError, match="SLURM_ARRAY_TASK_ID='x': not a whole number"):
        fanout_from(None, "auto", {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"})
    with pytest.raises(UserError, match="--world-size='two': not a whole number"):
        fanout_from(0, "two", {})
    with pytest.raises(UserError, match="--world-size: no rank in the environment"):
        fanout_from(None, "auto", {})
    with pytest.raises(UserError, match="--rank with --world-size auto"):
        fanout_from(1, "auto", slurm)
    with pytest.raises(UserError, match="runs under torchrun"):
        fanout_from(0, 2, {"WORLD_SIZE": "2"})


def test_the_schedulers_variables_alone_fan_nothing_out() -> None:
    # inside `sbatch -N2` / `salloc -N2` (SLURM_PROCID=0 SLURM_NTASKS=2), an array task, an
    # Indexed Job's pod: a command that did not ask for a fan-out writes every part
    for env in (
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
        {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"},
        {"JOB_COMPLETION_INDEX": "1", "RLHF_BATCH_WORLD_SIZE": "2"},
    ):
        assert fanout_from(None, None, env) is None, env


def machine(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A working directory and a model cache of its own."""
    home = tmp_path / name
    home.mkdir()
    return home, {**os.environ, **env, "RLHF_BATCH_CACHE": str(home / "cache"), "OMP_NUM_THREADS": "1"}


def stage(cmd: str, config: Path, *extra: str, cwd: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_batch", cmd, str(config), "--iter", "0", "--quiet", *extra],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err


@pytest.mark.slow
def test_three_independent_generate_processes_give_the_rows_of_one(
    make_config, s3_run: str, s3_server, tmp_path: Path
) -> None:
    local, local_cfg = make_config(name="local.toml", threads=1)
    remote, cfg = make_config(name="s3.toml", run_dir=s3_run, threads=1)
    finish([stage("generate", local, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})])
    machines = [machine(tmp_path, f"m{r}", s3_server.env()) for r in range(3)]
    procs = [
        stage("generate", remote, "--rank", str(r), "--world-size", "3", cwd=home, env=env)
        for r, (home, env) in enumerate(machines)
    ]
    finish(procs)
    sdir = layout.folder(cfg.run_dir, 0, layout.ROLLOUTS)
    m = manifests.manifest(sdir)
    assert m is not None and m["rows"] == 48  # 12 prompts x 4 samples, in 3 parts of 3 ranks
    assert sorted(p["file"] for p in m["parts"]) == [layout.part_name(r, r) for r in range(3)]
    assert rows(cfg.run_dir, "rollouts") == rows(local_cfg.run_dir, "rollouts")
    # a late or re-run rank finds the stage complete and changes nothing
    before = (sdir / layout.MANIFEST).read_text()
    home, env = machines[1]
    finish([stage("generate", remote, "--rank", "1", "--world-size", "3", cwd=home, env=env)])
    assert (sdir / layout.MANIFEST).read_text() == before
    # score fanned out over two processes on the same rollouts, one of them the last to finish
    procs = [
        stage("score", remote, "--rank", str(r), "--world-size", "2", cwd=h, env=e)
        for r, (h, e) in enumerate(machines[:2])
    ]
    finish(procs)
    finish([stage("score", local, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})])
    assert rows(cfg.run_dir, "scores") == rows(local_cfg.run_dir, "scores")


@pytest.mark.slow
def test_a_rank_alone_writes_its_parts_and_leaves_the_commit_to_the_last(
    make_config, s3_run: str, s3_server, tmp_path: Path
) -> None:
    remote, cfg = make_config(name="s3.toml", run_dir=s3_run, threads=1)
    home, env = machine(tmp_path, "m0", s3_server.env())
    finish([stage("generate", remote, "--rank", "0", "--world-size", "3", cwd=home, env=env)])
    sdir = layout.folder(cfg.run_dir, 0, layout.ROLLOUTS)
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(0, 0)]
    assert manifests.manifest(sdir) is None  # parts 1 and 2 are still to come
    # a retried rank may redo its own parts (--force): the others' stay, and no commit yet
    finish([stage("generate", remote, "--rank", "1", "--world-size", "3", "--force", cwd=home, env=env)])
    assert sorted(p.name for p in layout.list_parts(sdir)) == [layout.part_name(r, r) for r in (0, 1)]
    assert manifests.manifest(sdir) is None
    finish(
        [stage("generate", remote, "--rank", str(r), "--world-size", "3", cwd=home, env=env) for r in (2, 1)]
    )
    m = manifests.manifest(sdir)
    assert m is not None and m["rows"] == 48
