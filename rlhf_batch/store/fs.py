"""Where the run lives: a local directory (a plain path or ``file://``) or an object store
(``s3://bucket/prefix``, ``gs://bucket/prefix``) through fsspec (s3fs, gcsfs).

A local run directory is a `pathlib.Path`, exactly as always. A run on an object store is a
`upath.UPath` (universal-pathlib: the pathlib API over fsspec), so layout, manifests and
listings read the same on both. What differs is here: an object store has no rename, so a file
becomes visible only as one finished PUT (`put_file`; s3fs completes a multipart upload only
after its last part), a "directory" is a prefix, and model directories are copied to a local
cache before they are loaded (`local_dir`). Credentials and the endpoint come from the standard
environment (``AWS_*``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``), never from
the config; no key or secret is ever written into a manifest or a message.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from collections.abc import Callable
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


def run_path(run_dir: str | Path) -> Path:
    """The run directory (or a path below it) as a path object: `pathlib.Path` when local, a
    `UPath` on an object store (typed as Path: it has the same methods). A scheme whose
    filesystem package is missing is a one-line error, never a local folder named `s3:`."""
    if is_remote(run_dir):
        return cast(Path, run_dir)
    text = str(run_dir)
    s = scheme(text)
    if not s:
        return Path(text[len("file://") :] if text.startswith("file://") else text)
    if s not in PACKAGES:
        raise ConfigError(
            f"run_dir {text}: unknown scheme '{s}://'; use a local path, file://, s3:// or gs://"
        )
    pkg = PACKAGES[s]
    if importlib.util.find_spec(pkg) is None:
        raise ConfigError(
            f"run_dir {text}: the {s}:// store needs the {pkg} package: pip install 'rlhf-batch[{EXTRAS[pkg]}]'"
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
    the timeouts alone do not bound all waits (an upload waits for `100 Continue` with none)."""
    if getattr(fsys, "_deadline", None) is not None:
        return
    import asyncio

    from fsspec.asyn import sync_wrapper

    call, limit = fsys._call_s3, timeout("deadline")
    fsys.retries = TRIES_PER_REQUEST

    async def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(call(*args, **kwargs), limit)
        except TimeoutError:
            raise TimeoutError() from None  # sync() makes it FSTimeoutError: `retry` names it

    fsys._call_s3, fsys.call_s3, fsys._deadline = bounded, sync_wrapper(bounded, obj=fsys), limit


def timeout(which: str) -> float:
    """A store timeout in seconds (TIMEOUTS), from its environment variable or the default."""
    name, default = TIMEOUTS[which]
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name}={text}: must be a number of seconds > 0")
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


def is_remote(path: Any) -> bool:
    """Whether `path` is on an object store (a UPath with a remote protocol)."""
    protocol = getattr(path, "protocol", None)
    return isinstance(protocol, str) and protocol not in ("", "file", "local")


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
            if attempt == RETRIES - 1 or time.monotonic() - start + wait > timeout("deadline"):
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


def put_dir(local: Path, path: Path) -> None:
    """Upload every file below the local directory `local` to the prefix `path`."""
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        put_file(f, path / f.relative_to(local).as_posix())


def create(path: Path, data: bytes) -> bool:
    """Create `path` only if it does not exist (an object store's conditional create,
    If-None-Match: *; O_EXCL locally). False when it exists already."""
    if not is_remote(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    fs = filesystem(path)
    try:
        retry(path, lambda: fs.pipe_file(key(path), data, mode="create"))
    except FileExistsError:
        return False
    except (NotImplementedError, TypeError, ValueError) as e:
        raise StageError(
            f"{path}: this store does not support conditional create (If-None-Match: *), which the "
            f"run lock needs ({str(e).splitlines()[0]})"
        ) from None
    return True


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
    if not hasattr(fsys, "call_s3"):
        raise StageError(f"{path}: the run lock needs conditional writes (If-Match), supported on s3:// here")
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


def makedirs(path: Path) -> None:
    """A local directory and its parents; nothing on an object store (a prefix exists through
    its objects)."""
    if not is_remote(path):
        path.mkdir(parents=True, exist_ok=True)


def remove(path: Path) -> None:
    """Remove a file or a whole folder (prefix); nothing if it is not there."""
    if is_remote(path):
        guard(path)
        fs = filesystem(path)
        if retry(path, lambda: fs.exists(key(path))):
            retry(path, lambda: fs.rm(key(path), recursive=True))
        return
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def arrow_source(path: Path) -> tuple[str, Any]:
    """(path, filesystem) for pyarrow's readers: a local path as it is, a remote one through its
    fsspec filesystem."""
    if not is_remote(path):
        return str(path), None
    return key(path), filesystem(path)


def register(con: Any, paths: Any) -> None:
    """Let a DuckDB connection read the object store that `paths` live on (fsspec filesystem
    registered with DuckDB: its httpfs extension cannot be installed offline)."""
    for p in paths if isinstance(paths, list | tuple) else [paths]:
        if is_remote(p):
            fs = filesystem(p)
            if not con.filesystem_is_registered(
                fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            ):
                con.register_filesystem(fs)
            return


def local_side(run_dir: str | Path, name: str) -> Path:
    """A local directory for files that libraries write with local file APIs (TensorBoard event
    files, wandb's and MLflow's stores, DuckDB's spills): RUN_DIR/name for a local run, else a local directory
    beside the model cache, one per run URI."""
    root = run_path(run_dir)
    if not is_remote(root):
        return root / name
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return cache_root().parent / "runs" / digest / name


def cache_root() -> Path:
    """The local cache of model directories copied from a store ($RLHF_BATCH_CACHE, default
    ~/.cache/rlhf-batch/models)."""
    base = os.environ.get("RLHF_BATCH_CACHE") or os.path.join(os.path.expanduser("~/.cache"), "rlhf-batch")
    return Path(base) / "models"


def _get(fs: Any, path: Path, name: str, dest: Path) -> None:
    retry(path, lambda: fs.get_file(name, str(dest)))


def local_dir(path: Path) -> Path:
    """A model directory on the store copied into the local cache once per machine, keyed by its
    objects' names, sizes and ETags (another policy, another key); a local path as it is."""
    if not is_remote(path):
        return path
    fs = filesystem(path)
    listing = retry(path, lambda: fs.find(key(path), detail=True))
    if not listing:
        return path  # not there: the caller's checks name it
    sig = sorted(
        (name, info.get("size"), str(info.get("ETag") or info.get("etag") or ""))
        for name, info in listing.items()
    )
    digest = hashlib.sha256(repr(sig).encode()).hexdigest()[:24]
    out = cache_root() / digest
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
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
