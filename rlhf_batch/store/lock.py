"""The run lock: one command at a time writes a run (`run`, each stage command, `import`).

On a local disk it is an exclusive flock on RUN_DIR/.run.lock holding the owner's pid: the
kernel drops it when its holder dies, so a stale lock file (dead pid) is simply taken over.

On an object store there is no flock: the lock is the object RUN_DIR/.run.lock, created only if
it does not exist (a conditional PUT, ``If-None-Match: *``, which S3, GCS and MinIO honour). It
names its owner (pid, host) and carries a heartbeat that the holder rewrites every
HEARTBEAT_S seconds. A holder that died (a killed process, a lost machine) stops its heartbeat;
once the heartbeat is older than `stale_after()` (RLHF_BATCH_LOCK_STALE_S, default 120 s) the
next command takes the lock over and says so. To break a lock at once, delete the object
(``aws s3 rm s3://bucket/prefix/.run.lock``) after making sure its holder is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from rlhf_batch.errors import StageError
from rlhf_batch.store import fs
from rlhf_batch.store.layout import LOCK

HEARTBEAT_S = 30.0
LOCK_ENV = "RLHF_BATCH_RUN_LOCKED"  # set by `run` for its stage processes: it holds the lock


def stale_after() -> float:
    from rlhf_batch.runtime.env import seconds

    return seconds("RLHF_BATCH_LOCK_STALE_S", 4 * HEARTBEAT_S)


def lock_id(run_dir: str | Path) -> str:
    """How a run directory is named in LOCK_ENV: resolved locally, the URI on a store."""
    root = fs.run_path(run_dir)
    return str(root) if fs.is_remote(root) else str(root.resolve())


def stage_lock(run_dir: str) -> contextlib.AbstractContextManager[Any]:
    """The run lock for one command, so that it never writes under a running `run` or a second
    command: taken by rank 0 (torchrun's other ranks follow it), unless the `run` that started
    this process holds it already. A fanned-out process (--world-size > 1) takes none."""
    from rlhf_batch.runtime import dist

    if os.environ.get(LOCK_ENV) == lock_id(run_dir) or int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    if dist.fanned_out():  # N processes share the stage on purpose: whoever started them owns the run
        return contextlib.nullcontext()
    return _locked_and_recovered(fs.run_path(run_dir))


@contextlib.contextmanager
def _locked_and_recovered(run_dir: Path) -> Iterator[None]:
    """The run lock, then the swaps of `--force` that a kill interrupted finished (staging.py)."""
    from rlhf_batch.store import staging

    with RunLock(run_dir):
        staging.recover(run_dir)
        yield


def RunLock(run_dir: Path) -> contextlib.AbstractContextManager[Any]:  # noqa: N802 - used as a class
    """The lock of `run_dir`, local or on an object store."""
    return StoreLock(run_dir) if fs.is_remote(run_dir) else FileLock(run_dir)


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _holder(info: dict[str, Any]) -> str:
    return f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"


class FileLock:
    """An exclusive flock on RUN_DIR/.run.lock holding the owner's pid."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.file: IO[str] | None = None

    def __enter__(self) -> FileLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not self.path.is_file():
            raise StageError(f"{self.path}: is not a file; remove it (it is the run's lock file)")
        f = open(self.path, "a+")  # noqa: SIM115 - held for the lifetime of the run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise StageError(
                f"{self.path.parent}: another rlhf-batch command holds the lock ({holder}); "
                "wait for it or stop it"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(_holder(_owner()))
        f.flush()
        self.file = f
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


class StoreLock:
    """The lock object on an object store, created conditionally, with a heartbeat."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.owner = _owner()
        self.stop = threading.Event()
        self.beat: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({**self.owner, "heartbeat": time.time()}).encode()

    def __enter__(self) -> StoreLock:
        if not fs.create(self.path, self._record()):
            self._take_over_stale()
        self.beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self.beat.start()
        return self

    def _take_over_stale(self) -> None:
        try:
            info = json.loads(self.path.read_bytes())
        except (FileNotFoundError, json.JSONDecodeError):
            info = {}
        age = time.time() - float(info.get("heartbeat", 0))
        if age < stale_after():
            raise StageError(
                f"{self.path.parent}: another rlhf-batch command holds the lock ({_holder(info)}, "
                f"heartbeat {age:.0f} s ago); wait for it or stop it"
            )
        fs.remove(self.path)
        if not fs.create(self.path, self._record()):  # another command took it over first
            raise StageError(f"{self.path.parent}: another rlhf-batch command holds the lock; wait for it")
        print(
            f"run lock: took over the stale lock of {_holder(info)} (no heartbeat for {age:.0f} s)",
            flush=True,
        )

    def _heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat is retried at the next one
                fs.put_bytes(self.path, self._record())

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.beat is not None:
            self.beat.join(timeout=5)
        with contextlib.suppress(Exception):  # a lock left behind goes stale: the next command takes it
            fs.remove(self.path)
