"""pipelines/k8s/: the manifests of every stage and the driver that loops over iterations, run
against a shimmed `kubectl` that records what it would apply and answers each Job's state (no
cluster here). Every applied manifest is validated against the Kubernetes schemas
(kubernetes-validate, offline, --strict), its commands parse with the CLI (and torchrun's parser),
and a failed Job stops the loop."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import yaml

from tests.test_schedulers import PIPELINES, parse

REPO = PIPELINES.parent
VALIDATE = REPO / ".venv-deploy" / "bin" / "kubernetes-validate"  # make deploy
KUBECTL = """#!/usr/bin/env bash
log="{log}"
echo "$*" >> "$log/calls"
case "$1" in
  apply) n=$(( $(ls "$log" | grep -c yaml) + 1 )); cat > "$log/$n.yaml"; echo "applied $n" ;;
  get) if [ "$3" = "${{KUBECTL_FAIL:-}}" ]; then echo "Failed"; else echo "Complete"; fi ;;
  *) exit 2 ;;
esac
"""


def drive(
    tmp_path: Path, *args: str, **env: str
) -> tuple[subprocess.CompletedProcess, list[list[dict]], list[str]]:
    log = tmp_path / "log"
    log.mkdir(parents=True)
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(KUBECTL.format(log=log))
    kubectl.chmod(stat.S_IRWXU)
    base = {
        "IMAGE": "reg.example.com/rlhf-batch:cuda",
        "RUN_DIR": "s3://bucket/run7",
        "KUBECTL": str(kubectl),
    }
    res = subprocess.run(
        ["bash", str(PIPELINES / "k8s" / "run.sh"), *args],
        env={**os.environ, **base, "POLL": "0", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    files = sorted(log.glob("*.yaml"), key=lambda p: int(p.stem))
    applied = [list(yaml.safe_load_all(p.read_text())) for p in files]
    calls = (log / "calls").read_text().splitlines() if (log / "calls").exists() else []
    return res, applied, calls


def jobs(applied: list[list[dict]]) -> list[dict]:
    return [d for docs in applied for d in docs if d["kind"] == "Job"]


def test_every_applied_manifest_is_valid_against_the_kubernetes_schemas(tmp_path: Path) -> None:
    res, applied, _ = drive(tmp_path, "0", "1", WORKERS="3", NODES="2", GPUS="8")
    assert res.returncode == 0, res.stderr
    assert VALIDATE.exists(), "run `make deploy` (the suite's linters)"
    files = sorted((tmp_path / "log").glob("*.yaml"))
    out = subprocess.run(
        [str(VALIDATE), "--strict", *map(str, files)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" passed for resource ") == 7  # 6 Jobs and train's Service
    # the check can fail: a container command with a number in it, as an unquoted @K@ would give
    bad = tmp_path / "bad.yaml"
    job = jobs(applied)[0]
    job["spec"]["template"]["spec"]["containers"][0]["command"][4] = 0
    bad.write_text(yaml.safe_dump(job))
    out = subprocess.run([str(VALIDATE), "--strict", str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


def test_the_loop_runs_each_stage_of_each_iteration_in_order(tmp_path: Path) -> None:
    res, applied, calls = drive(tmp_path, "4", "6", WORKERS="3", NODES="2", GPUS="8")
    assert res.returncode == 0, res.stderr
    names = [j["metadata"]["name"] for j in jobs(applied)]
    per_iteration = ["eval", "generate", "score", "advantage", "train"]
    run = "run7-" + hashlib.sha256(b"s3://bucket/run7").hexdigest()[:8]  # RUN_DIR's name and hash
    assert names == [f"rlhf-{run}-{s}-{k}" for k in (4, 5) for s in per_iteration] + [f"rlhf-{run}-eval-6"]
    # each Job is waited for before the next is applied
    assert [c.split()[0] for c in calls[:4]] == ["apply", "apply", "get", "apply"]
    for j in jobs(applied):
        stage, k = j["metadata"]["name"].split("-")[3:]
        spec, (c,) = j["spec"], j["spec"]["template"]["spec"]["containers"]
        assert c["image"] == "reg.example.com/rlhf-batch:cuda"
        if stage in ("generate", "score", "eval"):
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
            assert env["RLHF_BATCH_WORLD_SIZE"] == "3"
            ctx = parse(c["command"][1:])
            assert (ctx.info_name, ctx.params["iteration"], ctx.params["world_size"]) == (
                stage,
                int(k),
                "auto",
            )
            assert ctx.params["set_"] == ["run_dir=s3://bucket/run7", "iterations=6"]
        elif stage == "advantage":
            assert "completionMode" not in spec and c["command"][:2] == ["/bin/sh", "-c"]
            assert c["command"][2] == 'rlhf-batch topup "$@" && rlhf-batch advantage "$@"'
            for name in ("topup", "advantage"):
                assert parse([name, *c["command"][4:]]).params["iteration"] == int(k)
        else:
            from torch.distributed.run import get_args_parser

            assert spec["completions"] == 2 and spec["template"]["spec"]["subdomain"] == f"rlhf-{run}-train"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
            assert "$(JOB_COMPLETION_INDEX)" in c["command"]  # Kubernetes fills it in: pod 1 here
            command = [("1" if w == "$(JOB_COMPLETION_INDEX)" else w) for w in c["command"][1:]]
            args = get_args_parser().parse_args(command)
            assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
            assert args.master_addr == f"rlhf-{run}-train-{k}-0.rlhf-{run}-train" and args.module
            assert parse(args.training_script_args).info_name == "train"
    services = [d for docs in applied for d in docs if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {f"rlhf-{run}-train"}
    assert all(s["spec"]["selector"]["rlhf-batch/run"] == run for s in services)


def test_a_failed_job_stops_the_loop(tmp_path: Path) -> None:
    res, applied, _ = drive(tmp_path, "0", "3", KUBECTL_FAIL="rlhf-r7-score-1", RUN_NAME="r7")
    assert res.returncode == 1
    assert "job/rlhf-r7-score-1 failed" in res.stderr and "run again from iteration 1" in res.stderr
    assert [j["metadata"]["name"] for j in jobs(applied)][-1] == "rlhf-r7-score-1"  # nothing after it


def test_two_runs_in_one_namespace_have_their_own_job_and_service_names(tmp_path: Path) -> None:
    """A Job's pod template is immutable: a second run applying the first one's Job names fails
    ("field is immutable"). Every name and the Service's selector carry the run."""
    a, applied_a, _ = drive(tmp_path / "a", "0", "1")
    b, applied_b, _ = drive(tmp_path / "b", "0", "1", RUN_DIR="s3://bucket/run8")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    names_a = {d["metadata"]["name"] for docs in applied_a for d in docs}
    names_b = {d["metadata"]["name"] for docs in applied_b for d in docs}
    assert not names_a & names_b
    bad = drive(tmp_path / "c", "0", "1", RUN_NAME="Not_A_Label")[0]
    assert bad.returncode == 2 and "RUN_NAME=Not_A_Label: must be a DNS label" in bad.stderr
