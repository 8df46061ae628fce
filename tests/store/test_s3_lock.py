"""The run lock on an object store (store/lock.py) against a real S3-protocol server (moto): a
live holder refuses a second command, a dead holder on this host is taken over at once, and a
holder that was paused past the stale limit and taken over is fenced: it stops before writing
and never deletes the lock it lost."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_batch.runtime import faults
from rlhf_batch.store import fs, layout
from rlhf_batch.store.fs import filesystem, key, run_path
from rlhf_batch.store.lock import LockLost, StoreLock
from tests.observe.test_tracking import write_config
from tests.reliability.harness import state
from tests.store.test_s3_reliability import rlhf


def stopped_at_first_part(command: str, config: Path, env: dict) -> subprocess.Popen:
    """`rlhf-batch COMMAND CONFIG` started, and waited for until it stops itself (SIGSTOP, fault
    point `stop:rollouts:part-0:tmp`) with its first part written locally, holding the lock."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_batch", command, str(config), "--quiet"],
        env={**env, faults.FAULT_ENV: "stop:rollouts:part-0:tmp"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while state(proc.pid) != "T" and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    return proc


def lock_record(run_dir: str) -> dict:
    return json.loads(fs.get_bytes(run_path(run_dir) / layout.LOCK))  # one GET (the heartbeat rewrites it)


def test_a_live_lock_refuses_a_second_command_in_one_line(s3_run: str, make_config) -> None:
    """A real holder (this process, its heartbeat running) against `generate`: refused, nothing
    written, the holder's lock untouched. A heartbeat that is not wall time (time.monotonic)
    would look stale to the second command and let it in."""
    path, cfg = make_config(run_dir=s3_run)
    with StoreLock(run_path(s3_run)) as held:
        done = rlhf("generate", str(path), "--quiet", env=os.environ.copy())
        assert lock_record(s3_run)["token"] == held.owner["token"]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert f"holds the lock (pid {os.getpid()} on " in lines[0]
    assert not layout.folder(cfg.run_dir, 0, layout.ROLLOUTS).exists()
    assert not (run_path(s3_run) / layout.LOCK).exists()  # released by its holder


def test_a_dead_holder_on_this_host_is_taken_over_at_once(s3_run: str, capsys) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(gone.stdout)
    # a fresh heartbeat, but its process is gone
    record = {"pid": dead, "host": socket.gethostname(), "since": "x", "heartbeat": time.time(), "token": "t"}
    assert fs.put_if(run_path(s3_run) / layout.LOCK, json.dumps(record).encode(), "*")
    with StoreLock(run_path(s3_run)) as second:
        assert lock_record(s3_run)["token"] == second.owner["token"]
    out = capsys.readouterr().out
    assert f"took over the stale lock of pid {dead} on " in out and "its process is gone" in out


def test_a_holder_taken_over_stops_before_its_commit_and_leaves_the_new_lock(
    s3_run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLHF_BATCH_LOCK_STALE_S", "0.4")
    root = run_path(s3_run)
    first = StoreLock(root).__enter__()
    first.stop.set()  # as if paused: no heartbeat
    first.beat.join()
    time.sleep(0.5)
    second = StoreLock(root).__enter__()
    try:
        with pytest.raises(LockLost, match="lost the run lock to pid"):
            first.check(root / "iter=0000/rollouts/_manifest.json", commit=True)
        first.__exit__(None, None, None)
        assert lock_record(s3_run)["token"] == second.owner["token"]  # not deleted by the loser
    finally:
        second.__exit__(None, None, None)
    assert not (root / layout.LOCK).exists()


def objects(root: Path) -> dict[str, str]:
    fsys, base = filesystem(root), key(root).rstrip("/")
    return {
        k: hashlib.sha256(fsys.cat_file(k)).hexdigest()
        for k in fsys.find(base)
        if not k.endswith(layout.LOCK)
    }


@pytest.mark.slow
def test_a_paused_run_taken_over_stops_without_writing(
    s3_run: str, tiny_model: Path, demo_prompts: Path, tmp_path: Path
) -> None:
    """`run` paused (SIGSTOP, as a suspended VM) past the stale limit, its lock taken over by a
    second holder, then resumed: it exits 1 with one line, writes nothing more, and leaves the
    second holder's lock in place. It stops itself (fault point `stop:...`) with its first part
    written locally, before its upload: paused from outside, it could be between the lock check
    and a request, which no fencing can call back (docs/across-machines.md)."""
    path = write_config(
        tmp_path / "c.toml", tiny_model, demo_prompts, run_dir=s3_run, iterations=1, in_process=True
    )
    env = {**os.environ, "RLHF_BATCH_LOCK_STALE_S": "1"}
    proc = stopped_at_first_part("run", path, env)
    root = run_path(s3_run)
    rollouts = layout.folder(s3_run, 0, layout.ROLLOUTS)
    try:
        assert state(proc.pid) == "T", f"the run did not stop at its first part (exit {proc.poll()})"
        assert (rollouts / layout.STARTED).exists() and not layout.list_parts(rollouts)
        time.sleep(1.5)  # past RLHF_BATCH_LOCK_STALE_S
        os.environ["RLHF_BATCH_LOCK_STALE_S"] = "1"
        second = StoreLock(root).__enter__()
        before = objects(root)
    finally:
        os.environ.pop("RLHF_BATCH_LOCK_STALE_S", None)
        os.kill(proc.pid, signal.SIGCONT)
    try:
        _, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, err
        assert "lost the run lock to pid" in lines[0] and "stopped before writing" in lines[0]
        assert objects(root) == before  # nothing written after the takeover
        assert lock_record(s3_run)["token"] == second.owner["token"]
    finally:
        second.__exit__(None, None, None)


@pytest.mark.slow
def test_a_holder_stopped_by_sigterm_releases_the_lock_and_a_killed_one_goes_stale_in_20_s(
    s3_run: str, make_config, capsys
) -> None:
    """A scheduler's retry on another host: after SIGTERM the lock is gone at once; after SIGKILL
    a lock whose heartbeat stopped 21 s ago (another host: its pid cannot be checked) is taken
    over without any RLHF_BATCH_LOCK_STALE_S, well before a retry delay (Airflow's: 60 s)."""
    path, _ = make_config(run_dir=s3_run)
    env = {k: v for k, v in os.environ.items() if k != "RLHF_BATCH_LOCK_STALE_S"}
    proc = stopped_at_first_part("generate", path, env)
    lock = run_path(s3_run) / layout.LOCK
    assert state(proc.pid) == "T", f"generate did not stop at its first part (exit {proc.poll()})"
    assert lock.exists()
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and not lock.exists()  # released on the way out
    record = {"pid": 1, "host": "elsewhere", "since": "x", "heartbeat": time.time() - 21, "token": "t"}
    assert fs.put_if(lock, json.dumps(record).encode(), "*")
    with StoreLock(run_path(s3_run)) as retry:
        assert lock_record(s3_run)["token"] == retry.owner["token"]
    assert "no heartbeat for 21 s" in capsys.readouterr().out
