"""The Slurm scripts in pipelines/ (Kubernetes: tests/test_k8s.py): their commands parse with the
CLI, and the Slurm scripts run here as Slurm would run them, in a simulated Slurm environment
(the array variables set by hand; `srun` and `scontrol` replaced by one-line shims on one host)
against the test S3 server. No real Slurm or Kubernetes cluster is involved."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from rlhf_batch.commands.cli import app
from rlhf_batch.store import layout, manifests

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"


def parse(args: list[str]) -> Any:
    """`rlhf-batch ARGS` parsed by the CLI (an unknown command or option raises), not run."""
    command = typer.main.get_command(app).commands[args[0]]  # type: ignore[attr-defined]
    return command.make_context(args[0], list(args[1:]))


def script_commands(path: Path) -> list[list[str]]:
    """The `rlhf-batch ...` commands of a script's body (and of `torchrun ... -m rlhf_batch ...`),
    with its positional parameters given values, as argument lists."""
    values = {'"$stage"': "generate", '"$config"': "c.toml", '"$it"': "0", '"$@"': "--set run_dir=s3://b/r"}
    out = []
    body = (line for line in path.read_text().replace("\\\n", " ").splitlines() if not line.startswith("#"))
    for line in body:
        for k, v in values.items():
            line = line.replace(k, v)
        words = shlex.split(line)
        if "rlhf-batch" in words:
            out.append(words[words.index("rlhf-batch") + 1 :])
        elif "rlhf_batch" in words:
            out.append(words[words.index("rlhf_batch") + 1 :])
    return out


def test_the_slurm_scripts_commands_parse_with_the_cli() -> None:
    fanout = script_commands(PIPELINES / "slurm-fanout.sbatch")
    train = script_commands(PIPELINES / "slurm-train.sbatch")
    assert [c[0] for c in fanout] == ["generate"] and [c[0] for c in train] == ["topup", "advantage", "train"]
    for cmd in fanout + train:
        assert parse(cmd).params["set_"] == ["run_dir=s3://b/r"]
    directives = (PIPELINES / "slurm-fanout.sbatch").read_text()
    assert "#SBATCH --array=0-7\n" in directives
    text = (PIPELINES / "slurm-train.sbatch").read_text()
    assert "srun torchrun --nnodes" in text and "--rdzv-backend c10d" in text
    # torchrun's own options, checked by torchrun's parser
    from torch.distributed.run import get_args_parser

    line = text.replace("\\\n", " ").split("srun torchrun ", 1)[1].splitlines()[0]
    line = line.replace('"$SLURM_NNODES"', "2").replace('"${gpus##*:}"', "8")
    line = line.replace('"$SLURM_JOB_ID"', "7").replace('"$head:${RDZV_PORT:-29500}"', "node1:29500")
    args = get_args_parser().parse_args(
        shlex.split(line.replace('"$config"', "c.toml").replace('"$it"', "0").replace('"$@"', ""))
    )
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.module) == (
        "2",
        "c10d",
        "node1:29500",
        True,
    )


def shims(tmp_path: Path) -> Path:
    """`srun` (one task on this host: runs its command) and `scontrol` (the node list is this host)."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for name, body in (("srun", 'exec "$@"'), ("scontrol", "echo 127.0.0.1")):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


@pytest.mark.slow
def test_the_slurm_scripts_run_one_iteration_on_s3_in_a_simulated_slurm(
    make_config, s3_run: str, s3_server, tmp_path: Path
) -> None:
    from rlhf_batch.commands.pipeline import run_pipeline
    from tests.s3server import free_port
    from tests.store.test_s3_run import rows, weights

    settings = {
        "threads": 1,
        "score": {"rows_per_part": 20},
        "train": {"lr": 1e-3, "tokens_per_step": 256, "ppo_epochs": 1},
    }
    local, local_cfg = make_config(name="local.toml", iterations=1, in_process=True, **settings)
    remote, cfg = make_config(name="s3.toml", run_dir=s3_run, **settings)
    run_pipeline(local, [], quiet=True)
    base = {
        **os.environ,
        **s3_server.env(),
        "PATH": f"{shims(tmp_path)}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }

    def sbatch(script: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(PIPELINES / script), *args],
            env={**base, **env},
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
        )

    for stage in ("generate", "score"):  # `sbatch --array=3-4`: tasks 3 and 4, ranks 0 and 1
        array = {"SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_JOB_ID": "41"}
        tasks = [
            sbatch(
                "slurm-fanout.sbatch", stage, str(remote), "0", env={**array, "SLURM_ARRAY_TASK_ID": str(i)}
            )
            for i in (3, 4)
        ]
        for t in tasks:
            _, err = t.communicate(timeout=900)
            assert t.returncode == 0, err[-3000:]
        m = manifests.manifest(
            layout.folder(s3_run, 0, layout.ROLLOUTS if stage == "generate" else layout.SCORES)
        )
        # 48 rows in 3 parts each: rank 0 wrote parts 0 and 2, rank 1 part 1
        assert m is not None and [p["file"] for p in m["parts"]] == [
            layout.part_name(0, 0),
            layout.part_name(1, 1),
            layout.part_name(0, 2),
        ]
    train_env = {
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_GPUS_ON_NODE": "1",
    }
    job = sbatch("slurm-train.sbatch", str(remote), "0", env={**train_env, "RDZV_PORT": str(free_port())})
    _, err = job.communicate(timeout=900)
    assert job.returncode == 0, err[-3000:]
    for stage in ("rollouts", "scores", "advantages"):
        assert rows(s3_run, stage) == rows(local_cfg.run_dir, stage), stage
    a, b = weights(s3_run, 0), weights(local_cfg.run_dir, 0)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_the_crontab_line_names_every_placeholder_path_of_its_config(tmp_path: Path) -> None:
    """The shipped crontab runs gpu_qwen_math.toml: its --set options must replace every
    `/path/to/...` placeholder of that config (the prompt sets of generate and eval), or the
    first cron run fails validation."""
    from rlhf_batch.config import load_config

    (line,) = (
        x for x in (PIPELINES / "crontab.example").read_text().splitlines() if x and not x.startswith("#")
    )
    words = shlex.split(line.split(" >> ", 1)[0])
    cmd = words[words.index(".venv/bin/rlhf-batch") + 1 :]
    ctx = parse(cmd)
    assert cmd[0] == "run" and ctx.params["config"] == Path("pipelines/gpu_qwen_math.toml")
    cfg = load_config(PIPELINES / "gpu_qwen_math.toml", ctx.params["set_"])
    left = [k for k, v in _flat(cfg.to_dict()) if isinstance(v, str) and v.startswith("/path/to/")]
    assert not left, left


def _flat(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
    return out
