"""The run lock: one command at a time writes a run (`run`, each stage command, `import`).

On a local disk it is an exclusive flock on RUN_DIR/.run.lock holding the owner's pid: the
kernel drops it when its holder dies, so a stale lock file (dead pid) is simply taken over.

On an object store there is no flock: the lock is the object RUN_DIR/.run.lock, created only if
it does not exist (a conditional PUT, ``If-None-Match: *``, which S3, GCS and MinIO honour). It
names its owner (pid, host, a random token) and carries a heartbeat (wall time) that the holder
rewrites every `beat_every()` seconds (HEARTBEAT_S, or a quarter of a shorter stale limit), each
time only if the object is still the version it wrote last (``If-Match`` on its ETag). A holder
whose process is gone on this host is taken over at once; one that stopped its heartbeat (a
killed process, a lost machine) once the heartbeat is older than `stale_after()`
(RLHF_BATCH_LOCK_STALE_S, default 20 s, shorter than the schedulers' retry delays); a holder
stopped by SIGTERM releases the lock as it exits. The takeover is itself conditional on the version it
read. A holder that was paused past the limit (a suspended VM, a long GC) and taken over is
fenced: its next heartbeat fails its condition, every manifest write first reads the lock and
checks the token (so do the stage processes of `run`, through TOKEN_ENV), and any write once
its heartbeat is overdue does too; it stops with one line and exit 1 and never deletes a lock it
no longer holds (the release is a delete conditional on its own version). To break a lock at
once, delete the object (``aws s3 rm s3://bucket/prefix/.run.lock``) after making sure its
holder is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from rlhf_batch.errors import StageError
from rlhf_batch.store import fs
from rlhf_batch.store.layout import LOCK

# 5 s beats, stale after 4 missed (20 s): a holder killed with SIGKILL (a lost node, an OOM kill)
# is provably gone before any scheduler's retry (Airflow's retry_delay here: 60 s; a Kubernetes
# Job's back-off: 10 s, 20 s, ...; a Slurm resubmission); SIGTERM releases the lock at once
HEARTBEAT_S = 5.0
TOKEN_ENV = "RLHF_BATCH_LOCK_TOKEN"  # set by the holder on a store for its stage processes
LOCK_ENV = "RLHF_BATCH_RUN_LOCKED"  # set by `run` for its stage processes: it holds the lock


def stale_after() -> float:
    from rlhf_batch.runtime.env import seconds

    return seconds("RLHF_BATCH_LOCK_STALE_S", 4 * HEARTBEAT_S)


def beat_every() -> float:
    """Seconds between heartbeats: HEARTBEAT_S, or a quarter of a shorter stale limit."""
    return min(HEARTBEAT_S, stale_after() / 4)


def lock_id(run_dir: str | Path) -> str:
    """How a run directory is named in LOCK_ENV: resolved locally, the URI on a store."""
    return str(fs.run_path(run_dir).resolve())  # a UPath resolves to itself


def stage_lock(run_dir: str) -> contextlib.AbstractContextManager[Any]:
    """The run lock for one command, so that it never writes under a running `run` or a second
    command: taken by rank 0 (torchrun's other ranks follow it), unless the `run` that started
    this process holds it already. A fanned-out process (--world-size > 1) takes none."""
    from rlhf_batch.runtime import dist

    if os.environ.get(LOCK_ENV) == lock_id(run_dir) or int(os.environ.get("RANK", "0")) != 0:
        root, token = fs.run_path(run_dir), os.environ.get(TOKEN_ENV)
        return TokenFence(root, token) if fs.store_of(root).fences and token else contextlib.nullcontext()
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
    """The lock of `run_dir`: an flock on a local disk, else a lock object its store fences
    (a store without versioned conditional writes is refused in one line)."""
    return FileLock(run_dir) if fs.store_of(run_dir).local else StoreLock(run_dir)


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
    """The lock object on an object store: created conditionally, kept by a heartbeat that is a
    conditional write on the lock's version (If-Match on its ETag), released only while held."""

    def __init__(self, run_dir: Path):
        self.path, self.store = run_dir / LOCK, fs.store_of(run_dir)
        self.owner = {**_owner(), "token": uuid.uuid4().hex}
        self.stop = threading.Event()
        self.beat: threading.Thread | None = None
        self.etag: str | None = None  # the lock object's version while this process holds it
        self.beaten = 0.0  # wall time of the last heartbeat written
        self.lost: str | None = None  # who holds the lock now, once this process lost it

    def _record(self) -> bytes:
        self.stamp = time.time()
        return json.dumps({**self.owner, "heartbeat": self.stamp}).encode()

    def __enter__(self) -> StoreLock:
        self.etag = self.store.put_if(self.path, self._record(), "*")
        if self.etag is None:
            self._take_over()
        self.beaten = self.stamp
        os.environ[TOKEN_ENV] = self.owner["token"]  # the stage processes of `run` check it too
        fs.fence = self.check
        self.on_term = _exit_on_sigterm()
        self.beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self.beat.start()
        return self

    def _take_over(self) -> None:
        """Take the lock over from a holder that is gone: its pid is dead on this host, or its
        heartbeat is older than `stale_after()`. The takeover is conditional on the version read,
        so of two commands taking it over together one wins."""
        info, etag = _read(self.path)
        if etag is None:  # released meanwhile
            self.etag = self.store.put_if(self.path, self._record(), "*")
        else:
            age = time.time() - float(info.get("heartbeat", 0))
            dead = _dead_here(info)
            if not dead and age < stale_after():
                raise StageError(
                    f"{self.path.parent}: another rlhf-batch command holds the lock ({_holder(info)}, "
                    f"heartbeat {age:.0f} s ago); wait for it or stop it"
                )
            self.etag = self.store.put_if(self.path, self._record(), etag)
            why = "its process is gone" if dead else f"no heartbeat for {age:.0f} s"
        if self.etag is None:  # another command took it first
            raise StageError(f"{self.path.parent}: another rlhf-batch command holds the lock; wait for it")
        if etag is not None:
            print(f"run lock: took over the stale lock of {_holder(info)} ({why})", flush=True)

    def _heartbeat(self) -> None:
        while not self.stop.wait(beat_every()):
            if self.lost is not None:
                return
            try:
                etag = self.store.put_if(self.path, self._record(), self.etag or "*")
            except Exception:  # noqa: BLE001 - a missed beat is retried at the next one
                continue
            if etag is None:  # the lock's version changed: another command took it over
                self.lost = _holder(_read(self.path)[0])
                return
            self.etag, self.beaten = etag, self.stamp

    def check(self, path: Path, commit: bool = False) -> None:
        """Before a write to the run (`fs.fence`): stop when the lock is lost. A commit (a
        manifest), or any write once the heartbeat is overdue (this process was paused), reads
        the lock first."""
        if self.lost is None and (commit or time.time() - self.beaten > stale_after() / 2):
            info, _ = _read(self.path)
            if info.get("token") != self.owner["token"]:
                self.lost = _holder(info) if info else "nobody (it was removed)"
        if self.lost is not None:
            raise LockLost(self.path, self.lost)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        _restore_sigterm(getattr(self, "on_term", None))
        if self.beat is not None:
            self.beat.join(timeout=5)
        fs.fence = None
        os.environ.pop(TOKEN_ENV, None)
        if self.lost is None and self.etag is not None:
            with contextlib.suppress(Exception):  # a lock left behind goes stale: the next command takes it
                self.store.delete_if(self.path, self.etag)  # only the version this process wrote


def _exit_on_sigterm() -> Any:
    """While a store lock is held: SIGTERM (a scheduler stopping the task, `kill`) raises
    SystemExit(143) in the main thread, so the lock is released on the way out instead of left
    to go stale. Returns the handler it replaced (None where it replaced none)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return None  # the process handles SIGTERM itself

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _restore_sigterm(previous: Any) -> None:
    import signal

    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


class LockLost(StageError):
    def __init__(self, path: Path, holder: str):
        super().__init__(
            f"{path.parent}: this command lost the run lock to {holder} (it was paused or cut off "
            f"longer than the stale limit); it stopped before writing. Finished work is kept"
        )


class TokenFence:
    """A stage process of `run` on an object store: before each commit it checks that the lock
    object still carries its `run`'s token (TOKEN_ENV)."""

    def __init__(self, run_dir: Path, token: str):
        self.path, self.token = run_dir / LOCK, token

    def check(self, path: Path, commit: bool = False) -> None:
        if commit:
            info, _ = _read(self.path)
            if info.get("token") != self.token:
                raise LockLost(self.path, _holder(info) if info else "nobody (it was removed)")

    def __enter__(self) -> TokenFence:
        fs.fence = self.check
        return self

    def __exit__(self, *exc: object) -> None:
        fs.fence = None


def _read(path: Path) -> tuple[dict[str, Any], str | None]:
    """The lock object's record and version (ETag); ({}, None) when there is none."""
    etag = fs.store_of(path).version(path)  # before the body: a newer body with this version fails If-Match
    if etag is None:
        return {}, None
    try:
        return json.loads(fs.get_bytes(path)), etag
    except FileNotFoundError:
        return {}, None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}, etag


def _dead_here(info: dict[str, Any]) -> bool:
    """Whether the holder is a process of this host that no longer runs."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return False
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
