"""Kills, a stale lock and an outage on a run directory in a real S3-protocol server (moto, on
127.0.0.1): every interrupted run resumes to the rows and weights of an uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_batch.store import layout, manifests
from rlhf_batch.store.fs import run_path
from tests.observe.test_tracking import write_config
from tests.s3server import Proxy, new_bucket
from tests.store.test_s3_run import rows, weights

SETTINGS = {"iterations": 2, "in_process": True}


def rlhf(*args: str, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=900,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_prompts: Path) -> str:
    """The uninterrupted run on local disk (equal to the same run on S3: test_s3_run.py)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    path = run_dir.parent / "c.toml"
    write_config(path, tiny_model, demo_prompts, run_dir=str(run_dir), **SETTINGS)
    done = rlhf("run", str(path), "--quiet", env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    return str(run_dir)


def same_as(reference: str, run_dir: str) -> None:
    for stage in ("rollouts", "scores", "advantages"):
        assert rows(run_dir, stage) == rows(reference, stage), stage
    for it in (0, 1):
        a, b = weights(run_dir, it), weights(reference, it)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), it


# where a kill lands: a part written but not renamed/uploaded, a part done, a manifest about to be
# written, a policy saved but not uploaded, in every stage
# two chains of kills, each in one run directory: every re-run takes over the killed holder's lock,
# resumes, and is killed at the next point; then a re-run to the end
KILL_CHAINS = {
    "generate+score": ["rollouts:part-1:tmp", "rollouts:manifest", "scores:part-0:done", "scores:manifest"],
    "advantage+train": [
        "advantages:part-0:tmp",
        "advantages:manifest:done",
        "train:model-loaded",
        "train:policy:tmp",
        "train:manifest",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("chain", list(KILL_CHAINS))
def test_kills_on_s3_resume_to_the_uninterrupted_run(
    chain: str, reference: str, s3_server, tiny_model: Path, demo_prompts: Path, tmp_path: Path, monkeypatch
) -> None:
    for k, v in s3_server.env().items():  # this process reads the store too
        monkeypatch.setenv(k, v)
    run_dir = f"s3://{new_bucket(s3_server)}/run"
    path = tmp_path / "c.toml"
    write_config(path, tiny_model, demo_prompts, run_dir=run_dir, **SETTINGS)
    env = {**os.environ, **s3_server.env(), "RLHF_BATCH_LOCK_STALE_S": "1"}
    for point in KILL_CHAINS[chain]:
        killed = rlhf("run", str(path), "--quiet", env={**env, "RLHF_BATCH_FAULT": point})
        assert killed.returncode == -9, f"{point}: {killed.stderr}"  # SIGKILL at the fault point
        assert (run_path(run_dir) / layout.LOCK).exists()  # a killed holder leaves its lock
        time.sleep(1.5)  # its heartbeat is older than RLHF_BATCH_LOCK_STALE_S
    resumed = rlhf("run", str(path), "--quiet", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "took over the stale lock of pid" in resumed.stdout
    same_as(reference, run_dir)
    tmp = [p for p in run_path(run_dir).rglob("*") if ".tmp" in p.name]
    assert tmp == []  # nothing half-written on the store


@pytest.mark.slow
def test_a_fresh_lock_refuses_a_second_command_in_one_line(s3_run: str, make_config) -> None:
    path, cfg = make_config(run_dir=s3_run)
    lock = run_path(s3_run) / layout.LOCK
    lock.write_bytes(
        json.dumps({"pid": 4242, "host": "node7", "since": "x", "heartbeat": time.time()}).encode()
    )
    done = rlhf("generate", str(path), "--quiet", env=os.environ.copy())
    assert done.returncode == 1
    assert (
        done.stderr.strip().splitlines() == [done.stderr.strip().splitlines()[0]]
        and "holds the lock (pid 4242 on node7" in done.stderr
    )
    assert not layout.folder(cfg.run_dir, 0, layout.ROLLOUTS).exists()


@pytest.mark.slow
def test_the_store_going_away_mid_stage_is_one_line_and_the_run_resumes(
    s3_server, reference: str, tiny_model: Path, demo_prompts: Path, tmp_path: Path, monkeypatch
) -> None:
    proxy = Proxy(s3_server.port)
    proxy.up()
    bucket = new_bucket(s3_server)
    run_dir = f"s3://{bucket}/run"
    path = tmp_path / "c.toml"
    write_config(path, tiny_model, demo_prompts, run_dir=run_dir, **SETTINGS)
    env = {
        **os.environ,
        **s3_server.env(),
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "RLHF_BATCH_LOCK_STALE_S": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_batch", "run", str(path), "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # watch the store directly (not through the proxy): cut it once iteration 0's rollouts are in
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    rollouts = layout.folder(run_dir, 0, layout.ROLLOUTS)
    deadline = time.monotonic() + 300
    while manifests.manifest(rollouts) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proxy.down()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: s3://{bucket}: the object store does not answer")
    assert "Finished work is kept" in lines[0] and "testing" not in lines[0]  # no credentials
    proxy.up()
    time.sleep(1.5)  # the lock of the failed run (left if its release failed too) goes stale
    resumed = rlhf("run", str(path), "--quiet", env=env)
    assert resumed.returncode == 0, resumed.stderr
    same_as(reference, run_dir)
    proxy.down()
