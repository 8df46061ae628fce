"""Where the run lives: a local directory (a plain path or ``file://``) or an object store
(``s3://bucket/prefix``, ``gs://bucket/prefix``) through fsspec (s3fs, gcsfs).

A local run directory is a `pathlib.Path`, exactly as always. A run on an object store is a
`upath.UPath` (universal-pathlib: the pathlib API over fsspec), so layout, manifests and
listings read the same on both. What differs is here: an object store has no rename, so a file
becomes visible only as one finished PUT (`put_file`; s3fs completes a multipart upload only
after its last part), a "directory" is a prefix, and model directories are copied to a local
cache before they are loaded (`local_dir`). That difference is the `Store` interface at the end of
this module (`LocalStore`, `FsspecStore`, `S3Store`, picked by URI scheme from `STORES` through
`store_of`): callers ask a path's store what it can do, never whether the path is remote.
Credentials and the endpoint come from the standard
environment (``AWS_*``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``), never from
the config; no key or secret is ever written into a manifest or a message.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from rlhf_batch.errors import ConfigError, StageError

T = TypeVar("T")
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}  # scheme -> fsspec package
EXTRAS = {"s3fs": "s3", "gcsfs": "gcs"}  # package -> rlhf-batch extra
RETRIES = 5  # transient store errors: tries of one operation, with exponential backoff
TRIES_PER_REQUEST = 2  # s3fs's own tries of one request (each bounded by the timeouts below)
# seconds: (environment variable, default); a store that stops answering ends the command
TIMEOUTS = {
    "connect": ("RLHF_BATCH_STORE_CONNECT_TIMEOUT_S", 10.0),  # to open a connection
    "read": ("RLHF_BATCH_STORE_READ_TIMEOUT_S", 60.0),  # between two reads of an answer
    "deadline": ("RLHF_BATCH_STORE_DEADLINE_S", 180.0),  # one store call, with its retries
}
retried = 0  # transient errors retried in this process (the manifests' timing records it)


def scheme(run_dir: str | Path) -> str:
    """The URI scheme of a run directory ("" for a local path or file://)."""
    text = str(run_dir)
    if "://" not in text:
        return ""
    s = text.split("://", 1)[0].lower()
    return "" if s in ("file", "local") else s


def run_path(run_dir: str | Path, what: str = "run_dir") -> Path:
    """The run directory (or any path of a config: a model, a prompt file) as a path object:
    `pathlib.Path` when local, a `UPath` on an object store (typed as Path: it has the same
    methods). A scheme whose filesystem package is missing is a one-line error naming `what`
    (the config key), never a local folder named `s3:`."""
    if not isinstance(run_dir, str | Path):  # a UPath already
        return cast(Path, run_dir)
    text = str(run_dir)
    s = scheme(text)
    if not s:
        return Path(text[len("file://") :] if text.startswith("file://") else text)
    if s not in PACKAGES:
        raise ConfigError(
            f"{what} {text}: unknown scheme '{s}://'; use a local path, file://, s3:// or gs://"
        )
    pkg = PACKAGES[s]
    if importlib.util.find_spec(pkg) is None:
        raise ConfigError(
            f"{what} {text}: the {s}:// store needs the {pkg} package: pip install 'rlhf-batch[{EXTRAS[pkg]}]'"
        )
    from upath import UPath

    # listings are never cached: other processes (ranks, machines) add parts while this one runs
    opts: dict[str, Any] = {"use_listings_cache": False}
    if pkg == "s3fs":  # no request waits forever, and botocore does not retry on top of s3fs
        opts["config_kwargs"] = {
            "connect_timeout": timeout("connect"),
            "read_timeout": timeout("read"),
            "retries": {"mode": "standard", "total_max_attempts": 1},
        }
    root = cast(Path, UPath(text, **opts))
    if pkg == "s3fs":
        _bound(root.fs)  # type: ignore[attr-defined]
    _used.setdefault(str(root).split("://", 1)[1].split("/", 1)[0], root)
    return root


_used: dict[str, Path] = {}  # bucket -> a path on it, for every store this process used


def _bound(fsys: Any) -> None:
    """Give every request of an s3fs filesystem (with s3fs's own tries) the store deadline:
    the timeouts alone do not bound all waits (an upload waits for `100 Continue` with none).
    The deadline counts from the first request the store left unanswered (`silent_since`, reset
    by any answer), across requests and their retries: a store that stops answering ends the
    command within it (and a connect timeout per call made after it), not after each of its
    calls (and the probe that names it) waited a deadline of its own."""
    if getattr(fsys, "_bounded", False):
        return
    import asyncio

    from fsspec.asyn import sync_wrapper

    call = fsys._call_s3
    fsys.retries = TRIES_PER_REQUEST

    async def bounded(*args: Any, **kwargs: Any) -> Any:
        global silent_since
        # read at each call: fsspec shares one filesystem among paths with the same options
        since, limit = silent_since, timeout("deadline")
        began = time.monotonic()
        # past the deadline a request still has the connect timeout: a store that is back answers
        left = limit if since is None else max(limit - (began - since), min(timeout("connect"), limit))
        try:
            out = await asyncio.wait_for(call(*args, **kwargs), left)
        except TimeoutError:
            silent_since = since if since is not None else began
            raise TimeoutError() from None  # sync() makes it FSTimeoutError: `retry` names it
        except Exception as e:
            answered = isinstance(e, FileNotFoundError | PermissionError | FileExistsError) or _refused(e)
            silent_since = None if answered else (since if since is not None else began)
            raise
        silent_since = None
        return out

    fsys._call_s3, fsys.call_s3, fsys._bounded = bounded, sync_wrapper(bounded, obj=fsys), True


silent_since: float | None = None  # when the store last left a request unanswered (None: it answers)


def timeout(which: str) -> float:
    """A store timeout in seconds (TIMEOUTS), from its environment variable or the default."""
    name, default = TIMEOUTS[which]
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):  # inf: a store that stops answering would never end it
        raise ConfigError(f"{name}={text}: must be a finite number of seconds > 0")
    return value


def refusal(e: BaseException, what: Path | str) -> str | None:
    """One line for a store error that trying again cannot fix: no credentials, credentials the
    store refuses, a bucket that does not exist. None for any other error."""
    name = type(e).__name__
    bucket = str(what).split("://", 1)[-1].split("/", 1)[0]
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (
            f"{what}: no credentials for the object store; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), then run again"
        )
    cause = e if getattr(e, "response", None) else getattr(e, "__cause__", None)
    code = str((getattr(cause, "response", None) or {}).get("Error", {}).get("Code", ""))
    if code == "NoSuchBucket":
        return f"{what}: the bucket '{bucket}' does not exist; create it or fix run_dir"
    if code in (
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AccessDenied",
    ):
        return (
            f"{what}: the object store refused the credentials ({code}); check AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY and the bucket's permissions"
        )
    return None


def unreachable(e: BaseException) -> str | None:
    """When a command fails and a store it used does not answer now, one line saying so (naming
    what failed); None when every store it used answers (the error is not the store's)."""
    for bucket, path in list(_used.items()):
        fs = path.fs  # type: ignore[attr-defined]
        try:
            fs.ls(bucket, refresh=True)
        except Exception as probe:  # noqa: BLE001 - any failure of the probe means no answer
            if (line := refusal(probe, f"{path.protocol}://{bucket}")) is not None:  # type: ignore[attr-defined]
                return line
            reason = str(probe).splitlines()[0] if str(probe) else type(probe).__name__
            what = str(e).splitlines()[0] if str(e) else type(e).__name__
            return (
                f"{path.protocol}://{bucket}: the object store does not answer ({reason}); the command "  # type: ignore[attr-defined]
                f"stopped at: {what}. Finished work is kept: run it again once the store is back"
            )
    return None


def filesystem(path: Path) -> Any:
    """The fsspec filesystem of a remote path."""
    return path.fs  # type: ignore[attr-defined]


def key(path: Path) -> str:
    """The object key of a remote path (bucket/prefix/..., as fsspec names it)."""
    return str(path.path)  # type: ignore[attr-defined]


def retry(what: Path | str, op: Callable[[], T]) -> T:
    """Run a store operation, retrying transient errors (connection, throttling, 5xx) with
    backoff 0.2, 0.4, ... s, for at most the store deadline; then one line naming the object.
    Missing objects and refused preconditions pass through at once; missing or refused
    credentials and a missing bucket are one line at once (`refusal`)."""
    global retried
    start = time.monotonic()
    for attempt in range(RETRIES):
        try:
            return op()
        except Exception as e:
            if (line := refusal(e, what)) is not None:
                raise StageError(line) from None
            final = (
                FileNotFoundError,
                FileExistsError,
                IsADirectoryError,
                NotADirectoryError,
                PermissionError,
            )
            if (
                isinstance(e, final)
                or _refused(e)
                or not isinstance(e, OSError | ConnectionError | TimeoutError)
            ):
                raise
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(e, TimeoutError):
                reason = f"no answer within RLHF_BATCH_STORE_DEADLINE_S = {timeout('deadline'):g} s"
            wait = 0.2 * 2**attempt
            since = start if silent_since is None else min(start, silent_since)
            if attempt == RETRIES - 1 or time.monotonic() - since + wait > timeout("deadline"):
                raise StageError(
                    f"{what}: the store did not answer ({reason}); run again once it is back"
                ) from None
            retried += 1
            time.sleep(wait)
    raise AssertionError("unreachable")


fence: Callable[..., None] | None = None  # set by the run lock: raises once the lock is lost


def guard(path: Path, commit: bool = False) -> None:
    """Before a write to a run on a store: the run lock's check that it is still held (a
    `commit`, a manifest, always reads the lock object)."""
    if fence is not None:
        fence(path, commit)


def put_file(local: Path, path: Path) -> None:
    """Upload a finished local file as the object `path` (one PUT, or a multipart upload that
    becomes visible only once complete)."""
    guard(path)
    fs = filesystem(path)
    retry(path, lambda: fs.put_file(str(local), key(path)))


def put_bytes(path: Path, data: bytes) -> None:
    """Write a small object whole (one PUT); a local file atomically is store/atomic's job."""
    guard(path)
    fs = filesystem(path)
    retry(path, lambda: fs.pipe_file(key(path), data))


def get_bytes(path: Path) -> bytes:
    """The whole object `path`, whatever version is current (one GET)."""
    fs = filesystem(path)
    return retry(path, lambda: fs.cat_file(key(path)))


UPLOADERS = 8  # files of a folder uploaded at once (a large one: a multipart upload, 10 parts at once)


def put_dir(local: Path, path: Path) -> None:
    """Upload every file below the local directory `local` to the prefix `path`, UPLOADERS at
    once: a policy's weight shards, tokenizer and config are requests that wait on the network,
    not on each other (the manifest written after the folder is what makes it count)."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    if len(files) < 2:
        for f in files:
            put_file(f, path / f.relative_to(local).as_posix())
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(UPLOADERS, len(files))) as pool:
        list(pool.map(lambda f: put_file(f, path / f.relative_to(local).as_posix()), files))


def put_new(local: Path, path: Path) -> bool:
    """Upload a finished local file as the object `path` only if there is none (If-None-Match: *):
    False when one is there. A late upload (a command paused past the run lock's stale limit
    that had it in flight) then never replaces what the command that took over wrote."""
    guard(path)
    fs = filesystem(path)
    try:
        retry(path, lambda: fs.put_file(str(local), key(path), mode="create"))
    except FileExistsError:
        return False
    return True


class Uploads:
    """A stage's parts uploaded in the background, at most `depth` at once (RLHF_BATCH_UPLOADS,
    default UPLOADERS; 0: each part before the next is computed): part n+1 is computed while part
    n travels. Each is a local file written into `scratch()`, removed once uploaded. `wait`
    returns when every upload is done and raises the first failure (a lost lock included:
    every request is fenced as it starts)."""

    def __init__(self) -> None:
        import tempfile
        from concurrent.futures import ThreadPoolExecutor

        from rlhf_batch.runtime.env import count

        self.depth = count("RLHF_BATCH_UPLOADS", UPLOADERS)
        self.pool = ThreadPoolExecutor(max(1, self.depth), thread_name_prefix="part-upload")
        self.dir = Path(tempfile.mkdtemp(prefix="rlhf-batch-parts-"))
        self.pending: list[Any] = []
        self.n = 0

    def scratch(self, name: str) -> Path:
        self.n += 1
        return self.dir / f"{self.n}-{name}"

    def submit(self, local: Path, upload: Callable[[], None]) -> None:
        def run() -> None:
            try:
                upload()
            finally:
                local.unlink(missing_ok=True)

        self.pending.append(self.pool.submit(run))
        while len([f for f in self.pending if not f.done()]) > self.depth:
            next(f for f in self.pending if not f.done()).result()  # back-pressure: the oldest first
        if self.depth == 0:
            self.wait()

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        errors = [f.exception() for f in pending]  # every one finished before any error is raised
        if first := next((e for e in errors if e is not None), None):
            raise first

    def close(self) -> None:
        """Wait for the uploads in flight (their errors dropped: the stage failed already)."""
        with contextlib.suppress(Exception):
            self.wait()
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def mirror(src: Path, dst: Path, last: str | None = None) -> None:
    """Make the prefix `dst` hold exactly the objects of the prefix `src` (server-side copies;
    objects of `dst` that `src` lacks are deleted first). The object named `last` is copied last."""
    guard(dst)
    fsys = filesystem(src)
    s, d = key(src).rstrip("/"), key(dst).rstrip("/")
    names = sorted(k[len(s) + 1 :] for k in retry(src, lambda: fsys.find(s)))
    gone = [k for k in retry(dst, lambda: fsys.find(d)) if k[len(d) + 1 :] not in names]
    if gone:
        retry(dst, lambda: fsys.rm(gone))
    for name in sorted(names, key=lambda n: n == last):
        _copy(fsys, f"{s}/{name}", f"{d}/{name}", dst / name)


def _copy(fsys: Any, src: str, dst: str, path: Path) -> None:
    retry(path, lambda: fsys.copy(src, dst))


def _refused(e: BaseException) -> bool:
    """Whether a store error is a refused precondition (HTTP 412, or 409 for a conditional
    write racing another)."""
    if isinstance(e, FileExistsError):
        return True
    cause = getattr(e, "__cause__", None)
    response = getattr(cause, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def _s3(path: Path) -> tuple[Any, str, str]:
    fsys = filesystem(path)
    bucket, name, _ = fsys.split_path(key(path))
    return fsys, bucket, name


def put_if(path: Path, data: bytes, match: str) -> str | None:
    """Write the small object `path` only if its version (ETag) is `match`, or with "*" only if
    it does not exist; the new version, or None when the condition failed."""
    fsys, bucket, name = _s3(path)
    cond = {"IfNoneMatch": "*"} if match == "*" else {"IfMatch": match}
    try:
        done = retry(path, lambda: fsys.call_s3("put_object", Bucket=bucket, Key=name, Body=data, **cond))
    except FileNotFoundError:  # If-Match on an object that is gone
        return None
    except OSError as e:
        if _refused(e):
            return None
        raise
    return str(done["ETag"])


def version(path: Path) -> str | None:
    """The version (ETag) of the object `path`, None when there is none."""
    fsys, bucket, name = _s3(path)
    try:
        return str(retry(path, lambda: fsys.call_s3("head_object", Bucket=bucket, Key=name))["ETag"])
    except FileNotFoundError:
        return None


def delete_if(path: Path, match: str) -> bool:
    """Delete the object `path` only if its version is still `match`."""
    fsys, bucket, name = _s3(path)
    try:
        retry(path, lambda: fsys.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=match))
    except FileNotFoundError:
        return False
    except OSError as e:
        if _refused(e):
            return False
        raise
    return True


def cache_root() -> Path:
    """The local cache of model directories copied from a store ($RLHF_BATCH_CACHE, default
    ~/.cache/rlhf-batch/models)."""
    base = os.environ.get("RLHF_BATCH_CACHE") or os.path.join(os.path.expanduser("~/.cache"), "rlhf-batch")
    return Path(base) / "models"


def _get(fs: Any, path: Path, name: str, dest: Path) -> None:
    retry(path, lambda: fs.get_file(name, str(dest)))


# The storage interface ----------------------------------------------------------------------

_durable = True  # the run's `fsync` setting (set_durable)


def set_durable(on: bool) -> None:
    """The config's `fsync`: false skips every fsync. Renames stay atomic, so a killed process
    still leaves the old state or the new one; only a power cut may lose the last writes."""
    global _durable
    _durable = on


def fsync_path(path: Path) -> None:
    """fsync a local file or directory (nothing when the run's `fsync` is off)."""
    if not _durable:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(path: Path, e: BaseException, scratch: Path | None = None) -> StageError:
    """A failed write (disk full, file too large, no permission) as a one-line error naming the
    file; `scratch`: the local path it was written at first (where a disk fills up)."""
    import errno

    from rlhf_batch.errors import ADVICE

    code = e.errno if isinstance(e, OSError) else None
    reason = os.strerror(code) if code else str(e).splitlines()[0]
    if not isinstance(e, OSError) and _disk_full(scratch or path):  # torch.save: "[enforce fail ...]"
        reason, code = os.strerror(28), 28  # ENOSPC
    if code == errno.ENOENT:
        return StageError(f"{path}: cannot write: the folder {path.parent} does not exist")
    advice = ADVICE.get(code or -1, "fix it and run again")
    return StageError(f"{path}: cannot write ({reason}); {advice}, finished work is kept")


def _disk_full(path: Path) -> bool:
    import shutil

    for d in (path, *path.parents):
        if d.exists():
            return shutil.disk_usage(d).free < (1 << 20)
    return False


class Store:
    """What a run needs from where it lives. One implementation per kind of store, picked from
    STORES by the path's URI scheme (`store_of`); nothing outside this module asks which kind a
    path is, only what its store can do (`local`, `renames`, `fences`). Paths are the run's own
    path objects (`run_path`): `pathlib.Path` locally, `UPath` on an object store."""

    local = False  # its paths are files of this machine (flock, fsync, hashing in place, hub revisions)
    renames = False  # renames a folder at once: a forced output is swapped in by renames, else by copies
    fences = False  # versioned conditional writes (If-Match): the run lock on it fences a lost holder
    poll_s = 1.0  # between two looks at a manifest another process writes

    def scratch(self, sibling: Path, name: str) -> contextlib.AbstractContextManager[Path]:
        """A local path to write a file or folder at before `put` makes it `name`'s: `sibling`
        (a hidden name beside it) where renames are atomic, else a local temporary folder's
        `name`. Whatever is left there is removed on leaving."""
        raise NotImplementedError

    def put(self, tmp: Path, path: Path) -> None:
        """Make the finished local file or folder `tmp` the file or folder `path` (replacing a
        folder there); a reader sees the old one or the new one (a folder on an object store:
        a prefix cannot appear at once, the manifest written after it is what makes it count)."""
        raise NotImplementedError

    def create(self, path: Path, data: bytes) -> bool:
        """Write `path` whole only if it does not exist; False when it does."""
        raise NotImplementedError

    def remove(self, path: Path) -> None:
        """Remove a file or a whole folder (prefix); nothing if it is not there."""
        raise NotImplementedError

    def rename(self, src: Path, dst: Path) -> bool:
        """Rename `src` to `dst` at once; False where the store cannot (nothing is done)."""
        return False

    def makedirs(self, path: Path) -> None:
        """A folder and its parents (a prefix on an object store exists through its objects)."""

    def sync(self, folder: Path) -> None:
        """Make the renames and writes in `folder` durable (fsync)."""

    def local_path(self, path: Path) -> Path:
        """A local copy of the folder `path` (a model directory) for libraries with local file
        APIs; the path itself where it is local."""
        return path

    def local_side(self, root: Path, name: str) -> Path:
        """A local folder for files of the run `root` that libraries write with local file APIs."""
        digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
        return cache_root().parent / "runs" / digest / name

    def arrow_source(self, path: Path) -> tuple[str, Any]:
        """(path, filesystem) for pyarrow's readers."""
        return str(path), None

    def register(self, con: Any, path: Path, replace: bool = False) -> None:
        """Let a DuckDB connection read the files of this store."""

    def same_bytes(self, a: Path, b: Path) -> bool:
        return a.read_bytes() == b.read_bytes()

    def put_if(self, path: Path, data: bytes, match: str) -> str | None:
        """Write the small object `path` only if its version is `match` ("*": only if absent);
        its new version, or None when the condition failed. Only where `fences`."""
        raise StageError(self.no_fencing(path))

    def version(self, path: Path) -> str | None:
        raise StageError(self.no_fencing(path))

    def delete_if(self, path: Path, match: str) -> bool:
        raise StageError(self.no_fencing(path))

    def no_fencing(self, path: Path) -> str:
        root = str(path.parent)
        s = root.split("://", 1)[0] if "://" in root else "this store"
        return (
            f"run_dir {root}: a run on {s}:// cannot be written: its run lock needs conditional writes "
            "on the lock's version (If-Match), implemented for s3:// only; use s3:// or a local run_dir"
        )


class LocalStore(Store):
    """A local directory: hidden temporary names, fsync, rename; an flock for the run lock."""

    local, renames = True, True
    poll_s = 0.01  # a stat

    @contextlib.contextmanager
    def scratch(self, sibling: Path, name: str) -> Iterator[Path]:
        try:
            yield sibling
        finally:
            self.remove(sibling)

    def put(self, tmp: Path, path: Path) -> None:
        if tmp.is_dir():
            for p in [*sorted(tmp.iterdir()), tmp]:
                fsync_path(p)
            if path.exists():
                shutil.rmtree(path)
        else:
            fsync_path(tmp)
        os.replace(tmp, path)
        self.sync(path.parent)

    def create(self, path: Path, data: bytes) -> bool:
        """A finished hidden file hard-linked to its name (O_EXCL with whole content)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            raise write_error(path, e) from e
        finally:
            tmp.unlink(missing_ok=True)
        self.sync(path.parent)
        return True

    def remove(self, path: Path) -> None:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def rename(self, src: Path, dst: Path) -> bool:
        os.rename(src, dst)
        return True

    def makedirs(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def sync(self, folder: Path) -> None:
        fsync_path(folder)

    def local_side(self, root: Path, name: str) -> Path:
        return root / name

    def same_bytes(self, a: Path, b: Path) -> bool:
        import filecmp

        return filecmp.cmp(a, b, shallow=False)


class FsspecStore(Store):
    """An object store through its fsspec filesystem (gcsfs, ...): no rename, so a file is
    written locally and becomes visible as one finished PUT; model folders are read through a
    local cached copy. Writing a run needs `fences` (S3Store)."""

    @contextlib.contextmanager
    def scratch(self, sibling: Path, name: str) -> Iterator[Path]:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlhf-batch-") as d:
            yield Path(d) / name

    def put(self, tmp: Path, path: Path) -> None:
        if tmp.is_dir():
            self.remove(path)
            put_dir(tmp, path)
            _keep(tmp, path)
        else:
            put_file(tmp, path)

    def create(self, path: Path, data: bytes) -> bool:
        """The store's conditional create (If-None-Match: *)."""
        fsys = filesystem(path)
        try:
            retry(path, lambda: fsys.pipe_file(key(path), data, mode="create"))
        except FileExistsError:
            return False
        except (NotImplementedError, TypeError, ValueError) as e:
            raise StageError(
                f"{path}: this store does not support conditional create (If-None-Match: *), which the "
                f"run needs ({str(e).splitlines()[0]})"
            ) from None
        return True

    def remove(self, path: Path) -> None:
        guard(path)
        fsys = filesystem(path)
        if retry(path, lambda: fsys.exists(key(path))):
            retry(path, lambda: fsys.rm(key(path), recursive=True))

    def local_path(self, path: Path) -> Path:
        return _cached(path)

    def arrow_source(self, path: Path) -> tuple[str, Any]:
        return key(path), filesystem(path)

    def register(self, con: Any, path: Path, replace: bool = False) -> None:
        fsys = filesystem(path)
        name = fsys.protocol if isinstance(fsys.protocol, str) else fsys.protocol[0]
        if con.filesystem_is_registered(name):
            if not replace:
                return
            con.unregister_filesystem(name)
        con.register_filesystem(fsys)


class S3Store(FsspecStore):
    """S3 and S3-compatible stores (s3fs): conditional writes on an object's version (ETag),
    so the run lock fences a holder that lost it."""

    fences = True

    def put_if(self, path: Path, data: bytes, match: str) -> str | None:
        return put_if(path, data, match)

    def version(self, path: Path) -> str | None:
        return version(path)

    def delete_if(self, path: Path, match: str) -> bool:
        return delete_if(path, match)


LOCAL, FSSPEC, S3 = LocalStore(), FsspecStore(), S3Store()
# URI scheme -> its store; a scheme here also needs its fsspec package in PACKAGES
STORES: dict[str, Store] = {
    "": LOCAL,
    "file": LOCAL,
    "local": LOCAL,
    "s3": S3,
    "s3a": S3,
    "gs": FSSPEC,
    "gcs": FSSPEC,
}


def store_of(path: Any) -> Store:
    """The store that holds `path` (a run path, or a run directory as text)."""
    protocol = getattr(path, "protocol", None)
    if not isinstance(protocol, str):
        protocol = scheme(path) if isinstance(path, str) else ""
    return STORES.get(protocol, FSSPEC)  # another fsspec filesystem: its generic store


def makedirs(path: Path) -> None:
    store_of(path).makedirs(path)


def remove(path: Path) -> None:
    store_of(path).remove(path)


def create(path: Path, data: bytes) -> bool:
    return store_of(path).create(path, data)


def arrow_source(path: Path) -> tuple[str, Any]:
    return store_of(path).arrow_source(path)


def local_dir(path: Path) -> Path:
    return store_of(path).local_path(path)


def local_side(run_dir: str | Path, name: str) -> Path:
    """A local directory for files that libraries write with local file APIs (TensorBoard event
    files, wandb's and MLflow's stores, DuckDB's spills): RUN_DIR/name for a local run, else a
    local directory beside the model cache, one per run URI."""
    root = run_path(run_dir)
    return store_of(root).local_side(root, name)


def register(con: Any, paths: Any, replace: bool = False) -> None:
    """Let a DuckDB connection read the store that `paths` live on (the fsspec filesystem
    registered with DuckDB: its httpfs extension cannot be installed offline); with `replace`,
    through the filesystem of `paths` (a `snapshot`'s) even where another one is registered."""
    for p in paths if isinstance(paths, list | tuple) else [paths]:
        store_of(p).register(con, p, replace)


def _signature(listing: dict[str, Any]) -> str:
    """The cache key of a folder on the store: its objects' names, sizes and ETags."""
    sig = sorted(
        (name, info.get("size"), str(info.get("ETag") or info.get("etag") or ""))
        for name, info in listing.items()
    )
    return hashlib.sha256(repr(sig).encode()).hexdigest()[:24]


def _keep(local: Path, path: Path) -> None:
    """After the local folder `local` was uploaded as `path`: move it into the model cache as
    `path`'s copy (one LIST for the objects' ETags), so this machine's next read of it (the next
    iteration's stages reading the policy train wrote here) downloads nothing."""
    fs = filesystem(path)
    out = cache_root() / _signature(retry(path, lambda: fs.find(key(path), detail=True)))
    if (out / ".complete").exists():
        return
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # layout.tmp_name's rule
    try:  # the upload is done: a cache that cannot take the copy only costs a download later
        tmp.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(local), str(tmp))  # a rename where the cache is on the same disk
        (tmp / ".complete").write_text(str(path))
        os.replace(tmp, out)
    except OSError:  # a full disk, or another process of this machine cached it first
        shutil.rmtree(tmp, ignore_errors=True)


def _cached(path: Path) -> Path:
    """A model directory on the store copied into the local cache once per machine, keyed by its
    objects' names, sizes and ETags (another policy, another key)."""
    fs = filesystem(path)
    listing = retry(path, lambda: fs.find(key(path), detail=True))
    if not listing:
        return path  # not there: the caller's checks name it
    out = cache_root() / _signature(listing)
    if (out / ".complete").exists():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # layout.tmp_name's rule (layout imports fs)
    prefix = key(path).rstrip("/") + "/"
    for name in listing:
        dest = tmp / name[len(prefix) :]
        dest.parent.mkdir(parents=True, exist_ok=True)
        _get(fs, path, name, dest)
    (tmp / ".complete").write_text(str(path))
    try:
        os.replace(tmp, out)
    except OSError:  # another process of this machine cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def snapshot(root: Path) -> Path:
    """`root` read through one listing of the run, for commands that only read it (`status`,
    `sql`, `report`): one recursive listing (a LIST request per 1000 objects) answers every later
    look at what exists, its size and ETag, below `root`, so reading a file is one GET; without it
    each existence check, glob and open is a HEAD or a LIST of its own. The answers are those of
    the moment of the listing (a writer's later parts are not seen: read commands show a run as
    it was when they started). Local paths are returned as they are."""
    if store_of(root).local or getattr(root, "storage_options", {}).get("use_listings_cache"):
        return root  # local, or a snapshot already
    from upath import UPath

    opts = {**root.storage_options, "use_listings_cache": True}  # type: ignore[attr-defined]
    snap = cast(Path, UPath(str(root), **opts))
    fsys = filesystem(snap)
    if hasattr(fsys, "_call_s3"):  # s3fs: the store deadline on each request, as run_path's
        _bound(fsys)
    fsys.invalidate_cache()  # the instance may be an earlier snapshot's (fsspec caches instances)
    retry(snap, lambda: fsys.find(key(snap)))  # fills the listings cache of every folder below
    _listed_below(fsys, key(snap).rstrip("/"))
    return snap


def _listed_below(fsys: Any, top: str) -> None:
    """Make a filesystem whose listings cache holds every folder below `top` answer that a path
    below a folder it does not hold is not there (fsspec asks the store: a HEAD and a LIST)."""
    if getattr(fsys, "_listed_top", None) is not None:
        fsys._listed_top = top
        return
    cached = fsys._ls_from_cache

    def ls_from_cache(path: str) -> Any:
        found = cached(path)
        top = fsys._listed_top
        if found is not None or not path.startswith(top + "/"):
            return found
        parent = fsys._parent(path)
        while len(parent) > len(top):  # the nearest listed folder above it lacks its folder
            parent = fsys._parent(parent)
            if parent in fsys.dircache:
                raise FileNotFoundError(path)
        return None  # nothing above it listed (a write since dropped the listings): ask the store

    fsys._ls_from_cache, fsys._listed_top = ls_from_cache, top
