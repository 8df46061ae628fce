"""Atomic writes: a file is written under a hidden temporary name, fsynced, then renamed, so a
reader never sees half a file and a kill leaves either the old state or the new one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_batch.errors import StageError
from rlhf_batch.faults import fault_point
from rlhf_batch.layout import tmp_name
from rlhf_batch.schemas import SCHEMA_VERSION, VERSION_KEY

COUNTS_KEY = b"rlhf_batch.counts"
_durable = True  # the run's `fsync` setting (set_durable)


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
    reason = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e).splitlines()[0]
    if not isinstance(e, OSError) and _disk_full(path):  # torch.save: "[enforce fail at inline_...]"
        reason = os.strerror(28)  # ENOSPC
    return StageError(
        f"{path}: cannot write ({reason}); free disk space and run again, finished work is kept"
    )


def _disk_full(path: Path) -> bool:
    import shutil

    for d in (path, *path.parents):
        if d.exists():
            return shutil.disk_usage(d).free < (1 << 20)
    return False


def fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable: after a power cut (not only a kill) no part
    that a later manifest lists can be missing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = tmp_name(path, os.getpid())
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.flush()
            fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from e


def write_parquet_atomic(
    path: Path, table: pa.Table, schema: pa.Schema, counts: dict | None = None, fault: str = ""
) -> None:
    """Write `table` cast to `schema` (zstd) under a temporary name, fsync, rename."""
    meta = {**(schema.metadata or {}), VERSION_KEY: str(SCHEMA_VERSION).encode()}
    if counts:
        meta[COUNTS_KEY] = json.dumps(counts).encode()
    table = table.select(schema.names).cast(schema).replace_schema_metadata(meta)
    tmp = tmp_name(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            fsync(f.fileno())
        fault_point(f"{fault}:tmp")
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from e
        raise


def write_dir_atomic(final: Path, write: Any) -> None:
    """Call `write(tmp)` on a fresh hidden directory next to `final`, fsync it and rename it to
    `final` (replacing an older one): a kill leaves the old directory or the new one."""
    import shutil

    from safetensors import SafetensorError

    from rlhf_batch.checkpoint import fsync_tree

    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        fsync_tree(tmp)
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, as each writer reports it
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(final, e) from e
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(final.parent)
