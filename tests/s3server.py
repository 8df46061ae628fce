"""A real S3-protocol server for the tests: moto's standalone server (`make s3` installs it in
.venv-s3), started on 127.0.0.1 on a free port, stopped at the end. Nothing is mocked: the code
under test talks HTTP to it through s3fs, as it would to S3 or MinIO."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
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


def hold_port(port: int = 0) -> socket.socket:
    """A port of 127.0.0.1 (the OS picks one for 0) held by a bound socket that does not listen:
    a connection to it is refused, and no other free_port() or outgoing connection of this
    machine (another pytest-xdist worker's) gets it, while the holder's own server, which binds
    it with SO_REUSEADDR (Python's socket servers and moto's do), still can."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    return s


class S3Server:
    """One moto server process; `start` and `stop` may be called again (same port, its data is
    lost on stop: moto keeps objects in memory). Its port is held from the start (hold_port), so
    a server of another worker cannot take it while this one starts."""

    def __init__(self, env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.extra_env = env or {}  # the server's own settings (e.g. INITIAL_NO_AUTH_ACTION_COUNT)
        self.log = log  # every request answered, one JSON line each (tests/s3log.py; `requests`)
        if not SERVER.exists():
            raise RuntimeError(f"{SERVER}: no moto server; run `make s3` (make test does)")
        self.held: socket.socket | None = hold_port()  # from now until stop()
        self.port = int(self.held.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> None:
        if self.held is None:  # started again
            self.held = hold_port(self.port)
        cmd = [str(SERVER), "-H", "127.0.0.1", "-p", str(self.port)]
        if self.log is not None:  # the same server and app, behind a counting WSGI layer
            cmd = [str(SERVER.parent / "python"), str(ROOT / "tests" / "s3log.py"), *cmd[1:]]
            cmd += ["--log", str(self.log), "--latency-file", str(self.log) + ".latency_ms"]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **self.extra_env},
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self._warm()
            time.sleep(0.1)
        raise RuntimeError(f"moto server did not start on {self.endpoint}")

    def _warm(self) -> None:
        """moto loads its S3 code on the first S3 request (seconds on a busy machine, more than the
        1 s read timeout of tests/store/test_s3_timeouts.py): made here, it is no test's request."""
        import s3fs

        fs = s3fs.S3FileSystem(
            key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
        )
        with contextlib.suppress(Exception):  # a server refusing the credentials has loaded it too
            fs.ls("")

    def set_latency(self, ms: float) -> None:
        """From now on each request waits `ms` milliseconds before it is answered (a server
        started with `log`): a store across a network rather than on this machine."""
        assert self.log is not None, "a server started without log=... has no latency setting"
        Path(str(self.log) + ".latency_ms").write_text(str(ms))

    def requests(self) -> list[dict]:
        """The requests answered so far, in order (a server started with `log`)."""
        import json

        assert self.log is not None, "a server started without log=... keeps no record"
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        self.proc = None
        if self.held is not None:
            self.held.close()
            self.held = None


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


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of the server: `down()` closes its port and every open
    connection (to the client the store is gone), `up()` opens it again on the same port, with
    the server's data intact (moto keeps objects in memory, so the server itself must stay up)."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.held = hold_port()  # kept while down(): the port stays this proxy's
        self.port = int(self.held.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()

    def up(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def down(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):  # wakes the accept() in its thread: closing alone
                self.listener.shutdown(socket.SHUT_RDWR)  # would leave the port listening till then
            self.listener.close()
            self.listener = None
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self.conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            server = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class Silent:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a store that
    hangs): what a client sends is read and dropped."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()
