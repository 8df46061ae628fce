"""Atomic writes: a file is written under a hidden temporary name, fsynced, then renamed, so a
reader never sees half a file and a kill leaves either the old state or the new one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.store import fs
from rlhf_batch.store.layout import leftovers, tmp_name
from rlhf_batch.store.schemas import SCHEMA_VERSION, VERSION_KEY

COUNTS_KEY = b"rlhf_batch.counts"
IDENTITY_KEY = b"rlhf_batch.identity"  # the located identity of the stage run that wrote a part
T = TypeVar("T")
set_durable = fs.set_durable  # the config's `fsync` (false: no fsync; renames stay atomic)
write_error = fs.write_error


def fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable: after a power cut (not only a kill) no part
    that a later manifest lists can be missing (nothing on an object store)."""
    fs.store_of(path).sync(path)


def write_file_atomic(path: Path, write: Callable[[Path], T], fault: str = "") -> T:
    """Call `write(tmp)` to write a file at a scratch path, then make it `path` at once (its
    store's `put`: fsync and rename locally, one PUT on an object store): a reader never sees
    half a file. The one way every run file is written."""
    store = fs.store_of(path)
    with store.scratch(tmp_name(path, os.getpid()), path.name) as tmp:
        try:
            result = write(tmp)
            if fault:
                fault_point(f"{fault}:tmp")
            store.put(tmp, path)
        except OSError as e:
            raise write_error(path, e, tmp) from e
    return result


def write_json_atomic(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_exclusive(path: Path, obj: Any) -> bool:
    """Write `path` whole only if it does not exist yet (False if it does): an object store's
    conditional create; locally a finished temporary file hard-linked to its name."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    return fs.store_of(path).create(path, text.encode())


def write_parquet_atomic(
    path: Path,
    table: pa.Table,
    schema: pa.Schema,
    counts: dict | None = None,
    fault: str = "",
    identity: str = "",
) -> None:
    """Write `table` cast to `schema` (zstd) under a temporary name, fsync, rename (`part_table`)."""
    table = part_table(table, schema, counts, identity)
    write_file_atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"), fault)


def part_table(
    table: pa.Table, schema: pa.Schema, counts: dict | None = None, identity: str = ""
) -> pa.Table:
    """`table` cast to `schema`, with the schema version, `counts` and `identity` (the stage
    run's, which a commit checks in parts it did not write) in its metadata."""
    meta = {**(schema.metadata or {}), VERSION_KEY: str(SCHEMA_VERSION).encode()}
    if counts:
        meta[COUNTS_KEY] = json.dumps(counts).encode()
    if identity:
        meta[IDENTITY_KEY] = identity.encode()
    return table.select(schema.names).cast(schema).replace_schema_metadata(meta)


def umask() -> int:
    """The process's umask, read without changing it (/proc; else set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask_says(root: Path) -> None:
    """Give the files and folders below the local folder `root` the permissions the umask allows
    a new file (a writer like safetensors' creates its files 0600: pods running as another uid
    could not read the model); bits already set stay."""
    allowed = ~umask()
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        want = mode | ((0o777 if path.is_dir() else 0o666) & allowed)
        if want != mode:
            path.chmod(want & 0o7777)


def write_dir_atomic(final: Path, write: Callable[[Path], T], *, replace: bool = True, fault: str = "") -> T:
    """Call `write(tmp)` on a fresh scratch directory, then make it `final` (its store's `put`:
    fsync and rename locally, so a kill leaves the old directory or the new one; uploaded file by
    file on an object store, where the manifest written after it is what makes it count). An
    older `final` is replaced, or with `replace=False` kept (another writer made it first: the new
    copy is dropped)."""
    from safetensors import SafetensorError

    store = fs.store_of(final)
    for stale in leftovers(final.parent, final.name) if store.local else []:  # of a killed writer
        store.remove(stale)  # (one writer: the run lock; an object store's scratch is local)
    with store.scratch(tmp_name(final, os.getpid()), final.name) as tmp:
        try:
            tmp.mkdir(parents=True)
            result = write(tmp)
            as_umask_says(tmp)
            fault_point(f"dir:{final.name}:tmp")
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, as each writer reports it
            raise write_error(final, e, tmp) from e
        if fault:
            fault_point(f"{fault}:tmp")
        if replace or not final.exists():
            try:
                store.put(tmp, final)
            except OSError as e:
                raise write_error(final, e, tmp) from e
    return result
