"""pipelines/slurm-run.sh against shimmed `sbatch` and `scancel` that record what they are given
(no Slurm here): the chain of one iteration, its dependencies, the job scripts (their commands
parse with the CLI and torchrun's parser; the train script run with shimmed `srun`, `scontrol`,
`rlhf-batch` and `torchrun` takes --nproc-per-node from the GPUs Slurm gives the node), the
resubmission for the next iteration, and the cancelling of the chain when a submission fails."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from tests.test_schedulers import PIPELINES, parse

SBATCH = """#!/usr/bin/env bash
n=$(( $(ls "{log}" | grep -c args) + 1 ))
printf '%s\\n' "$@" > "{log}/$n.args"
if [ -t 0 ] || [ "${{!#}}" != "${{!#%.sh}}" ]; then : > "{log}/$n.script"; else cat > "{log}/$n.script"; fi
[ "$n" = "${{SBATCH_FAIL_AT:-0}}" ] && {{ echo "sbatch: error: Batch job submission failed" >&2; exit 1; }}
echo "$((100 + n));cluster"
"""


def shim(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text(body if body.startswith("#!") else f"#!/usr/bin/env bash\n{body}\n")
    (bin_dir / name).chmod(stat.S_IRWXU)


def slurm(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    shim(bin_dir, "sbatch", SBATCH.format(log=log))
    shim(bin_dir, "scancel", f'echo "$@" >> "{log}/scancel"')
    return bin_dir, log


def drive(
    tmp_path: Path, *args: str, **env: str
) -> tuple[subprocess.CompletedProcess, list[tuple[list, str]]]:
    bin_dir, log = slurm(tmp_path)
    res = subprocess.run(
        ["bash", str(PIPELINES / "slurm-run.sh"), *args],
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    n = len(list(log.glob("*.args")))
    calls = [
        ((log / f"{i}.args").read_text().splitlines(), (log / f"{i}.script").read_text())
        for i in range(1, n + 1)
    ]
    return res, calls


def option(argv: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"{name}=")), None)


def command(script: str, word: str) -> list[str]:
    """The arguments after `word` on the script's line that runs it."""
    line = next(x for x in script.replace("\\\n", " ").splitlines() if f" {word} " in f" {x} ")
    words = shlex.split(line)
    return words[words.index(word) + 1 :]


def test_one_iterations_chain_and_the_next_submission(tmp_path: Path) -> None:
    res, calls = drive(tmp_path, "/opt/run.toml", "3", "10", "--set", "run_dir=s3://b/r", WORKERS="4")
    assert res.returncode == 0, res.stderr
    names = [option(a, "--job-name") for a, _ in calls]
    assert names == ["rlhf-eval-3", "rlhf-generate-3", "rlhf-score-3", "rlhf-train-3", "rlhf-run-4"]
    deps = [(option(a, "--dependency"), option(a, "--kill-on-invalid-dep")) for a, _ in calls]
    # ids 101..105 (the shim's); every dependent is cancelled by Slurm when what it waits on fails
    assert deps == [
        (None, None),
        (None, None),
        ("afterok:102", "yes"),
        ("afterok:103", "yes"),
        ("afterok:104:101", "yes"),  # the next iteration after train and this eval: a failed eval stops it
    ]
    for (argv, script), stage in zip(calls[:3], ("eval", "generate", "score"), strict=True):
        assert option(argv, "--array") == "0-3" and "--parsable" in argv
        ctx = parse(command(script, "rlhf-batch"))
        assert (ctx.info_name, ctx.params["iteration"], ctx.params["world_size"]) == (stage, 3, "auto")
        assert ctx.params["set_"] == ["run_dir=s3://b/r", "iterations=10"]
        assert ctx.params.get("if_due", stage == "eval") is (stage == "eval")
    argv, _ = calls[4]  # the driver again, for iteration 4, with the same arguments
    assert argv[-6:] == [
        str(PIPELINES / "slurm-run.sh"),
        "/opt/run.toml",
        "4",
        "10",
        "--set",
        "run_dir=s3://b/r",
    ]
    assert "iteration 3: generate 102, score 103, train 104; iteration 4: 105" in res.stdout


def test_the_train_job_takes_its_ranks_per_node_from_slurms_gpus(tmp_path: Path) -> None:
    res, calls = drive(tmp_path, "/opt/run.toml", "0", "1", "--set", "run_dir=s3://b/r")
    assert res.returncode == 0, res.stderr
    argv, script = calls[3]
    assert {"--nodes=2", "--gpus-per-node=8"} <= set(argv)
    from torch.distributed.run import get_args_parser

    bin_dir = tmp_path / "node-bin"
    bin_dir.mkdir()
    for name in ("rlhf-batch", "torchrun"):
        shim(bin_dir, name, f'echo "{name} $*" >> "{tmp_path}/ran"')
    shim(bin_dir, "srun", 'exec "$@"')
    shim(bin_dir, "scontrol", "echo node7; echo node8")
    (tmp_path / "train.sh").write_text(script)
    for gpus, nproc in (({"SLURM_GPUS_ON_NODE": "4"}, "4"), ({"SLURM_GPUS_PER_NODE": "h100:2"}, "2")):
        (tmp_path / "ran").unlink(missing_ok=True)
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[7-8]"}
        env |= {"SLURM_NNODES": "2", "SLURM_JOB_ID": "9", **gpus}
        subprocess.run(["bash", str(tmp_path / "train.sh")], env=env, check=True, timeout=30)
        ran = [shlex.split(x) for x in (tmp_path / "ran").read_text().splitlines()]
        assert [r[:2] for r in ran] == [
            ["rlhf-batch", "topup"],
            ["rlhf-batch", "advantage"],
            ["torchrun", "--nnodes"],
        ]
        args = get_args_parser().parse_args(ran[2][1:])
        assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.module) == (
            "2",
            nproc,
            "node7:29500",
            True,
        )
        assert (
            parse(
                args.training_script_args and [args.training_script, *args.training_script_args][1:]
            ).info_name
            == "train"
        )


def test_the_last_iteration_submits_only_its_eval(tmp_path: Path) -> None:
    res, calls = drive(tmp_path, "/opt/run.toml", "10", "10")
    assert res.returncode == 0, res.stderr
    assert [option(a, "--job-name") for a, _ in calls] == ["rlhf-eval-10"]


@pytest.mark.parametrize("fail_at", [3, 5])
def test_a_failed_submission_cancels_what_the_chain_submitted(tmp_path: Path, fail_at: int) -> None:
    res, calls = drive(tmp_path, "/opt/run.toml", "0", "2", SBATCH_FAIL_AT=str(fail_at))
    assert res.returncode != 0 and "submission failed" in res.stderr
    # calls 1..fail_at-1 were submitted (ids 101...): all cancelled, nothing half-submitted runs
    assert (tmp_path / "log" / "scancel").read_text().split() == [str(100 + i) for i in range(1, fail_at)]
