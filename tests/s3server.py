"""A real S3-protocol server for the tests: moto's standalone server (`make s3` installs it in
.venv-s3), started on 127.0.0.1 on a free port, stopped at the end. Nothing is mocked: the code
under test talks HTTP to it through s3fs, as it would to S3 or MinIO."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(os.environ.get("RLHF_BATCH_MOTO", ROOT / ".venv-s3" / "bin" / "moto_server"))
CREDENTIALS = {  # moto accepts any; never real ones
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """One moto server process; `start` and `stop` may be called again (same port, its data is
    lost on stop: moto keeps objects in memory)."""

    def __init__(self) -> None:
        if not SERVER.exists():
            raise RuntimeError(f"{SERVER}: no moto server; run `make s3` (make test does)")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"moto server did not start on {self.endpoint}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def s3_env(server: S3Server) -> Iterator[None]:
    """The server's endpoint and test credentials in os.environ for the block."""
    old = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_bucket(server: S3Server) -> str:
    """Create a fresh bucket on the server (through s3fs, as the code under test talks)."""
    import s3fs

    name = f"run-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(
        key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=server.endpoint,
        skip_instance_cache=True,
    )
    fs.mkdir(name)
    return name
