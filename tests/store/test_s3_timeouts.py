"""A store that stops answering, a missing bucket, missing or refused credentials: each ends the
command with its own line, within the store deadline, and nothing is retried that cannot
succeed (store/fs.py). Real `rlhf-batch` subprocesses against moto's S3 server, a paused one, and
a socket that accepts and never answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.observe.test_tracking import write_config
from tests.s3server import CREDENTIALS, S3Server, Silent, new_bucket

FAST = {  # seconds: a hung store is noticed quickly here (the defaults are 10, 60, 180)
    "RLHF_BATCH_STORE_CONNECT_TIMEOUT_S": "1",
    "RLHF_BATCH_STORE_READ_TIMEOUT_S": "1",
    "RLHF_BATCH_STORE_DEADLINE_S": "3",
}
# for a server that answers: a 1 s read timeout would take a busy machine's slow answer (the
# server beside other test processes) for a hang; an answer retried as transient still ends in
# "does not answer" after the 20 s deadline, which each message checked below is not
PATIENT = {**FAST, "RLHF_BATCH_STORE_READ_TIMEOUT_S": "10", "RLHF_BATCH_STORE_DEADLINE_S": "20"}


def generate(path: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return done, time.monotonic() - start


def one_line(done: subprocess.CompletedProcess, *words: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert "testing" not in lines[0]  # no credentials in a message
    return lines[0]


@pytest.fixture
def config(tiny_model: Path, demo_prompts: Path, tmp_path: Path):
    def make(run_dir: str) -> Path:
        return write_config(tmp_path / "c.toml", tiny_model, demo_prompts, run_dir=run_dir)

    return make


@pytest.mark.slow
def test_a_store_that_never_answers_ends_the_command_in_one_line(config, s3_server) -> None:
    """A socket that accepts and never answers, then the real server paused (SIGSTOP): each ends
    `generate` with one line within the timeouts (the command's own start-up aside)."""
    silent = Silent()
    try:
        env = {**os.environ, **CREDENTIALS, **FAST, "AWS_ENDPOINT_URL": silent.endpoint}
        done, took = generate(config("s3://hung/run"), env)
    finally:
        silent.close()
    one_line(done, "s3://hung", "not answer")
    bucket = new_bucket(s3_server)
    os.killpg(s3_server.proc.pid, signal.SIGSTOP)
    try:
        paused, took_paused = generate(
            config(f"s3://{bucket}/run"), {**os.environ, **s3_server.env(), **FAST}
        )
    finally:
        os.killpg(s3_server.proc.pid, signal.SIGCONT)
    one_line(paused, f"s3://{bucket}", "not answer")
    # without the timeouts the first call alone waited minutes; start-up (imports) is most of it
    assert took < 60 and took_paused < 60, (took, took_paused)


@pytest.mark.slow
def test_missing_bucket_and_credentials_each_have_their_own_line(config, s3_server, tmp_path: Path) -> None:
    env = {**os.environ, **s3_server.env(), **PATIENT}
    one_line(generate(config("s3://no-such-bucket/run"), env)[0], "bucket 'no-such-bucket' does not exist")
    bare = {k: v for k, v in env.items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"}
    bare |= {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    bucket = new_bucket(s3_server)
    one_line(generate(config(f"s3://{bucket}/run"), bare)[0], "no credentials")
    strict = S3Server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # checks every key it is given
    strict.start()
    try:
        done, took = generate(config("s3://any/run"), {**os.environ, **strict.env(), **PATIENT})
    finally:
        strict.stop()
    one_line(done, "refused the credentials (InvalidAccessKeyId)")
    assert took < 60  # not retried as transient (5 tries with backoff, each retried by s3fs)


def test_a_paused_store_ends_the_commands_calls_within_one_deadline(s3_server, monkeypatch) -> None:
    """Two reads and the probe that names the store, against a paused server: together they end
    within the deadline (5 s here) from the first unanswered request, not each after its own
    (a read alone took 2 attempts x up to 5 s before)."""
    from rlhf_batch.errors import StageError
    from rlhf_batch.store import fs

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    # a bucket this process used earlier under the default timeouts (60 s reads): the probe that
    # names the store asks it too, within this deadline (it took 2 x 60 s when its filesystem
    # kept the deadline it was made with)
    fs.put_bytes(fs.run_path(f"s3://{new_bucket(s3_server)}/earlier"), b"x")
    monkeypatch.setenv("RLHF_BATCH_STORE_CONNECT_TIMEOUT_S", "1")
    monkeypatch.setenv("RLHF_BATCH_STORE_READ_TIMEOUT_S", "2")
    monkeypatch.setenv("RLHF_BATCH_STORE_DEADLINE_S", "5")
    path = fs.run_path(f"s3://{new_bucket(s3_server)}/object")
    fs.put_bytes(path, b"x")
    os.killpg(s3_server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        for _ in range(2):
            with pytest.raises(StageError, match="the store did not answer") as e:
                fs.get_bytes(path)
        line = fs.unreachable(e.value)
        took = time.monotonic() - start
    finally:
        os.killpg(s3_server.proc.pid, signal.SIGCONT)
    assert line is not None and "does not answer" in line
    assert took < 5 + 1 + 1 + 2, took  # the deadline, a connect timeout for each later call, slack
    assert fs.get_bytes(path) == b"x"  # the store back: its first answer resets the clock
