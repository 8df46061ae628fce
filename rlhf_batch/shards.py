"""The stage contract on disk: Hive layout, atomic part writes, manifests, resume, ranks.

    RUN_DIR/iter=0003/<stage>/part-RRRRR-NNNNN.parquet   (R = writing rank, N = part number)
    RUN_DIR/iter=0003/<stage>/_manifest.json             (written last: the stage is complete)

Work is cut into numbered parts whose content depends only on the part number, never on the
number of ranks; rank r writes the parts n with n % world == r. A part is written to a hidden
temporary name, fsynced and renamed, so a reader never sees half a file; a re-run skips the
parts that exist and ends with exactly the rows of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_batch import dist, tracking
from rlhf_batch.errors import SchemaError, StageError
from rlhf_batch.schemas import SCHEMA_VERSION, VERSION_KEY, check_values, validate

MANIFEST = "_manifest.json"
STARTED = "_started.json"
COUNTS_KEY = b"rlhf_batch.counts"
FAULT_ENV = "RLHF_BATCH_FAULT"


def iter_dir(run_dir: str | Path, it: int) -> Path:
    return Path(run_dir) / f"iter={it:04d}"


def stage_dir(run_dir: str | Path, it: int, stage: str) -> Path:
    return iter_dir(run_dir, it) / stage


def part_name(rank: int, n: int) -> str:
    return f"part-{rank:05d}-{n:05d}.parquet"


def part_number(path: Path) -> int:
    return int(path.stem.split("-")[2])


def list_parts(sdir: Path) -> list[Path]:
    """Finished parts on disk (temporary files are hidden and never match)."""
    return sorted(sdir.glob("part-*-*.parquet"), key=lambda p: (part_number(p), p.name))


def write_error(path: Path, e: BaseException) -> StageError:
    """A failed write (disk full, file too large, no permission) as a one-line error naming the file."""
    reason = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e).splitlines()[0]
    if not isinstance(e, OSError) and _disk_full(
        path
    ):  # torch.save: "[enforce fail at inline_container.cc...]"
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
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from e


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e})") from None


def fault_point(name: str) -> None:
    """Fault injection for the reliability tests: SIGKILL this process when $RLHF_BATCH_FAULT
    names this point (e.g. 'rollouts:part-2:tmp', 'scores:part-0:done', 'train:manifest')."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def write_parquet_atomic(
    path: Path, table: pa.Table, schema: pa.Schema, counts: dict | None = None, fault: str = ""
) -> None:
    """Write `table` cast to `schema` (zstd) under a temporary name, fsync, rename."""
    meta = {**(schema.metadata or {}), VERSION_KEY: str(SCHEMA_VERSION).encode()}
    if counts:
        meta[COUNTS_KEY] = json.dumps(counts).encode()
    table = table.select(schema.names).cast(schema).replace_schema_metadata(meta)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        fault_point(f"{fault}:tmp")
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from e
        raise


def read_part(path: Path, schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    """Read one part, checking it against `schema`; errors name the file and the column."""
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise SchemaError(f"{path}: not a readable Parquet file ({e})") from None
    validate(pf.schema_arrow, schema, str(path))
    try:
        return pf.read(columns=columns)
    except (OSError, pa.ArrowInvalid) as e:
        raise SchemaError(f"{path}: cannot read ({e})") from None


def part_counts(path: Path) -> dict[str, int]:
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[COUNTS_KEY]) if COUNTS_KEY in meta else {}


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_fingerprint(path: str | Path) -> str:
    """Content hash of a file, or of every file below a directory (names, sizes, bytes)."""
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for q in files:
        h.update(str(q.relative_to(p) if p.is_dir() else q.name).encode())
        with open(q, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def manifest(sdir: Path) -> dict[str, Any] | None:
    path = sdir / MANIFEST
    return read_json(path) if path.exists() else None


def read_stage(sdir: Path, schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    """All rows of a complete stage, in part order, schema-checked."""
    m = manifest(sdir)
    if m is None:
        raise StageError(f"{sdir}: stage is not complete (no {MANIFEST}); run it first")
    tables = []
    for p in m["parts"]:
        t = read_part(sdir / p["file"], schema, columns)
        if t.num_rows != p["rows"]:
            raise SchemaError(
                f"{sdir / p['file']}: has {t.num_rows} rows, its stage's {MANIFEST} lists {p['rows']}; "
                "the file was changed after the stage completed: re-run the stage with --force"
            )
        tables.append(t)
    if not tables:
        return schema.empty_table() if columns is None else schema.empty_table().select(columns)
    table = pa.concat_tables(tables, promote_options="permissive")
    check_values(table, str(sdir))
    return table


class StageRun:
    """One stage of one iteration: skip if complete, resume if partial, manifest at the end.

    `config` is the part of the config that decides the stage's result and `inputs` the
    fingerprints of what it reads; a complete or partial stage written with other values is
    refused unless `force` is set, in which case its files are removed first (explicitly asked
    for, never silently). `resolved`, the whole resolved config, is recorded in the manifest
    as `resolved_config` (for the record: it is not compared).
    """

    def __init__(
        self,
        sdir: Path,
        stage: str,
        config: dict,
        inputs: dict,
        force: bool = False,
        resolved: dict | None = None,
    ):
        self.sdir, self.stage, self.resolved = sdir, stage, resolved
        self.rank, self.world = dist.rank_world()
        self.identity = {"config": config, "inputs": inputs, "schema_version": SCHEMA_VERSION}
        self.key = fingerprint(self.identity)
        if force and self.rank == 0 and sdir.exists():
            for p in [*list_parts(sdir), sdir / MANIFEST, sdir / STARTED]:
                p.unlink(missing_ok=True)
        dist.barrier()
        done = manifest(sdir)
        self.complete = done is not None
        if done is not None and done.get("key") != self.key:
            raise StageError(
                f"{sdir}: stage is complete with a different config or inputs ({differences(done, self.identity)}); "
                "re-run it with --force to replace it"
            )
        started = sdir / STARTED
        # a run that failed before writing any part leaves nothing to protect: a new config takes over
        before = read_json(started) if not self.complete and started.exists() else None
        if before is not None and before.get("key") != self.key and list_parts(sdir):
            raise StageError(
                f"{sdir}: a partial run with a different config or inputs is here ({differences(before, self.identity)}); "
                "re-run with the same config, or with --force to start over"
            )
        if not self.complete and self.rank == 0:
            sdir.mkdir(parents=True, exist_ok=True)
            for tmp in sdir.glob(".*.tmp"):  # a killed writer's leftovers (parts, manifest, _started)
                tmp.unlink(missing_ok=True)
            write_json_atomic(started, {"key": self.key, **self.identity})
        dist.barrier()

    def todo(self, n_parts: int) -> list[int]:
        """This rank's part numbers that are not on disk yet."""
        have = {part_number(p) for p in list_parts(self.sdir)}
        return [n for n in range(n_parts) if n % self.world == self.rank and n not in have]

    def write(self, n: int, table: pa.Table, schema: pa.Schema, counts: dict | None = None) -> Path:
        path = self.sdir / part_name(self.rank, n)
        write_parquet_atomic(path, table, schema, counts, fault=f"{self.stage}:part-{n}")
        fault_point(f"{self.stage}:part-{n}:done")
        return path

    def finish(self, n_parts: int, extra: dict | None = None) -> dict[str, Any] | None:
        """After every rank is done: rank 0 checks the parts and writes the manifest."""
        dist.barrier()
        result = None
        if self.rank == 0:
            fault_point(f"{self.stage}:manifest")
            record = {"resolved_config": self.resolved} if self.resolved is not None else {}
            result = write_manifest(
                self.sdir, self.stage, n_parts, self.key, self.identity, {**record, **(extra or {})}
            )
            tracking.log_stage(self.resolved, self.sdir, result)  # live trackers (report_to); never raises
        dist.barrier()
        return result


def differences(old: dict[str, Any], new: dict[str, Any], limit: int = 3) -> str:
    """Which dotted keys of the identity (config, inputs, schema_version) differ between what is
    on disk (`old`) and this run (`new`): the first `limit`, with their values when short (not for
    inputs, whose values are content hashes)."""

    def flat(d: Any, prefix: str) -> dict[str, str]:
        if isinstance(d, dict):
            return {k: v for key, sub in d.items() for k, v in flat(sub, f"{prefix}.{key}").items()}
        return {prefix: json.dumps(d, sort_keys=True, default=str)}

    a, b = (
        {k: v for key in ("config", "inputs", "schema_version") for k, v in flat(x.get(key), key).items()}
        for x in (old, new)
    )
    diff = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    shown = []
    for k in diff[:limit]:
        was, now = a.get(k, "missing"), b.get(k, "missing")
        short = max(len(was), len(now)) <= 40 and not k.startswith("inputs.")  # inputs: content hashes
        shown.append(f"{k}: {was} on disk, {now} now" if short else f"{k} changed")
    more = f" and {len(diff) - limit} more" if len(diff) > limit else ""
    return "; ".join(shown) + more if shown else "written by another version"


def write_manifest(
    sdir: Path, stage: str, n_parts: int, key: str, identity: dict, extra: dict | None
) -> dict[str, Any]:
    by_n: dict[int, Path] = {}
    for p in list_parts(sdir):
        by_n.setdefault(part_number(p), p)
    missing = [n for n in range(n_parts) if n not in by_n]
    if missing:
        raise StageError(f"{sdir}: parts {missing[:5]} are missing; re-run the stage to finish them")
    parts, counts = [], _Counter()
    for n in range(n_parts):
        path = by_n[n]
        rows = pq.ParquetFile(path).metadata.num_rows
        parts.append({"file": path.name, "rows": rows})
        counts.add(part_counts(path))
    m = {
        "stage": stage,
        "key": key,
        **identity,
        "parts": parts,
        "rows": sum(p["rows"] for p in parts),
        "counts": dict(counts),
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),
    }
    write_json_atomic(sdir / MANIFEST, m)
    (sdir / STARTED).unlink(missing_ok=True)
    return m


class _Counter(dict):
    def add(self, other: dict[str, int]) -> None:
        for k, v in other.items():
            self[k] = self.get(k, 0) + v


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("rlhf-batch", "torch", "transformers", "pyarrow", "duckdb"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


def policy_dir(run_dir: str | Path, it: int) -> Path:
    """Where `train` of iteration `it` writes the new policy (a Hugging Face model dir)."""
    return iter_dir(run_dir, it) / "policy"
