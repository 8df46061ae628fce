"""Atomic writes: a file is written under a hidden temporary name, fsynced, then renamed, so a
reader never sees half a file and a kill leaves either the old state or the new one."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_batch.errors import ADVICE, StageError
from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.store import fs
from rlhf_batch.store.layout import leftovers, tmp_name
from rlhf_batch.store.schemas import SCHEMA_VERSION, VERSION_KEY

COUNTS_KEY = b"rlhf_batch.counts"
IDENTITY_KEY = b"rlhf_batch.identity"  # the located identity of the stage run that wrote a part
_durable = True  # the run's `fsync` setting (set_durable)
T = TypeVar("T")


def set_durable(on: bool) -> None:
    """The config's `fsync`: false skips every fsync. Renames stay atomic, so a killed process
    still leaves the old state or the new one; only a power cut may lose the last writes."""
    global _durable
    _durable = on


def fsync(fd: int) -> None:
    if _durable:
        os.fsync(fd)


def write_error(path: Path, e: BaseException) -> StageError:
    """A failed write (disk full, file too large, no permission) as a one-line error naming the file."""
    code = e.errno if isinstance(e, OSError) else None
    reason = os.strerror(code) if code else str(e).splitlines()[0]
    if not isinstance(e, OSError) and _disk_full(path):  # torch.save: "[enforce fail at inline_...]"
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


def fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable: after a power cut (not only a kill) no part
    that a later manifest lists can be missing."""
    if fs.is_remote(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, write: Callable[[Path], T], fault: str = "") -> T:
    """Call `write(tmp)` to write a hidden temporary file next to `path`, fsync it and rename it to
    `path`: a reader never sees half a file. The one way every run file is written. On an object
    store the file is written locally, then uploaded as one object (there is no rename)."""
    if fs.is_remote(path):
        return _put_written(path, write, fault)
    tmp = tmp_name(path, os.getpid())
    try:
        result = write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            fsync(fd)
        finally:
            os.close(fd)
        if fault:
            fault_point(f"{fault}:tmp")
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from e
        raise
    return result


def _put_written(path: Path, write: Callable[[Path], T], fault: str) -> T:
    """`write` into a local temporary file, then one PUT of the finished object."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rlhf-batch-") as d:
        tmp = Path(d) / path.name
        result = write(tmp)
        if fault:
            fault_point(f"{fault}:tmp")
        fs.put_file(tmp, path)
    return result


def write_json_atomic(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_exclusive(path: Path, obj: Any) -> bool:
    """Write `path` whole only if it does not exist yet (False if it does): an object store's
    conditional create; locally a finished temporary file hard-linked to its name."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    if fs.is_remote(path):
        return fs.create(path, text.encode())
    tmp = tmp_name(path, os.getpid())
    try:
        tmp.write_text(text)
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as e:
        raise write_error(path, e) from e
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def write_parquet_atomic(
    path: Path,
    table: pa.Table,
    schema: pa.Schema,
    counts: dict | None = None,
    fault: str = "",
    identity: str = "",
) -> None:
    """Write `table` cast to `schema` (zstd) under a temporary name, fsync, rename; `identity`:
    the stage run's, recorded in the part's metadata (a fan-out's commit checks the others')."""
    meta = {**(schema.metadata or {}), VERSION_KEY: str(SCHEMA_VERSION).encode()}
    if counts:
        meta[COUNTS_KEY] = json.dumps(counts).encode()
    if identity:
        meta[IDENTITY_KEY] = identity.encode()
    table = table.select(schema.names).cast(schema).replace_schema_metadata(meta)
    write_file_atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"), fault)


def write_dir_atomic(final: Path, write: Callable[[Path], T], *, replace: bool = True, fault: str = "") -> T:
    """Call `write(tmp)` on a fresh hidden directory next to `final`, fsync it and rename it to
    `final`: a kill leaves the old directory or the new one. An older `final` is replaced, or with
    `replace=False` kept (another writer made it first: the new copy is dropped)."""
    import shutil

    from safetensors import SafetensorError

    if fs.is_remote(final):
        return _put_dir(final, write, replace, fault)
    for stale in leftovers(final.parent, final.name):  # of a killed writer (one writer: the run lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tmp_name(final, os.getpid())
    try:
        tmp.mkdir(parents=True)
        result = write(tmp)
        fault_point(f"dir:{final.name}:tmp")
        fsync_tree(tmp)
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, as each writer reports it
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(final, e) from e
    if fault:
        fault_point(f"{fault}:tmp")
    if final.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return result
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return result


def _put_dir(final: Path, write: Callable[[Path], T], replace: bool, fault: str) -> T:
    """On an object store: `write` into a local temporary directory, then upload it file by file.
    A prefix cannot appear at once: what makes it count is the manifest written after it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rlhf-batch-") as d:
        tmp = Path(d) / final.name
        tmp.mkdir()
        result = write(tmp)
        if fault:
            fault_point(f"{fault}:tmp")
        if final.exists():
            if not replace:
                return result
            fs.remove(final)
        fs.put_dir(tmp, final)
    return result


def fsync_tree(path: Path) -> None:
    for p in [*sorted(path.iterdir()), path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            fsync(fd)
        finally:
            os.close(fd)
