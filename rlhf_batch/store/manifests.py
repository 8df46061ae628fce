"""Manifests and reads: a folder is complete when its `_manifest.json` exists (written last). It
lists every part with its row count, the identity the folder was written with (config, input
fingerprints, schema version), the summed per-part counts and package versions."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_batch.errors import SchemaError, StageError
from rlhf_batch.store import layout
from rlhf_batch.store.atomic import COUNTS_KEY, IDENTITY_KEY, write_json_atomic, write_json_exclusive
from rlhf_batch.store.fs import arrow_source, guard, run_path, store_of
from rlhf_batch.store.layout import MANIFEST, STARTED, list_parts, part_number
from rlhf_batch.store.schemas import check_values, validate


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e})") from None


def manifest(sdir: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None while it is not complete (`current`: a forced run's
    committed output while it is copied into place on an object store)."""
    path = current(sdir) / MANIFEST
    return read_json(path) if path.exists() else None


_READ: dict[Path, Any] | None = None  # the manifests read so far inside `manifests_read_once`


@contextlib.contextmanager
def manifests_read_once() -> Iterator[None]:
    """Within it, `manifest_of` reads each folder's manifest from disk once: for a command that
    reads a run and writes nothing (`status`), whose views and rows look at the same manifests
    several times (thousands on a long run)."""
    global _READ
    outer = _READ
    _READ = {} if outer is None else outer
    try:
        yield
    finally:
        _READ = outer


def manifest_of(folder: Path) -> dict[str, Any] | None:
    """`manifest(folder)`, read once inside `manifests_read_once`."""
    if _READ is None:
        return manifest(folder)
    if folder not in _READ:
        _READ[folder] = manifest(folder)
    return _READ[folder]


def current(sdir: Path) -> Path:
    """The folder holding the current output of `sdir`: `sdir` itself, or, while a forced run's
    committed output is being swapped in (its staged manifest written, the folder itself without
    one: copied over object by object on a store, renamed locally), the staged folder it comes
    from. The staged manifest is the one write that makes the new output current: a reader never
    finds the folder incomplete in between (store/staging.py)."""
    if (sdir / MANIFEST).exists():
        return sdir
    new = layout.staged(sdir)
    if (new / MANIFEST).exists():
        return new
    return sdir  # not complete, or the swap finished between the two looks: its manifest is there


def parquet_file(path: Path) -> pq.ParquetFile:
    """A Parquet file of the run, local or on the object store."""
    source, filesystem = arrow_source(path)
    return pq.ParquetFile(source, filesystem=filesystem)


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    return parquet_file(path).read(columns=columns)


def read_part(path: Path, schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    """Read one part, checking it against `schema`; errors name the file and the column."""
    try:
        pf = parquet_file(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise SchemaError(f"{path}: not a readable Parquet file ({e})") from None
    validate(pf.schema_arrow, schema, str(path))
    try:
        return pf.read(columns=columns)
    except (OSError, pa.ArrowInvalid) as e:
        raise SchemaError(f"{path}: cannot read ({e})") from None


def part_counts(path: Path) -> dict[str, int]:
    return footer(path)[1]


def footer(path: Path) -> tuple[int, dict[str, int]]:
    """(rows, counts) of a part, from its Parquet footer (one open, one read of the footer)."""
    return footer_identity(path)[:2]  # type: ignore[return-value]


def footer_identity(path: Path) -> tuple[int, dict[str, int], str | None]:
    """(rows, counts, the identity of the stage run that wrote it, or None: an older part)."""
    pf = parquet_file(path)
    meta = pf.schema_arrow.metadata or {}
    counts = json.loads(meta[COUNTS_KEY]) if COUNTS_KEY in meta else {}
    return pf.metadata.num_rows, counts, meta[IDENTITY_KEY].decode() if IDENTITY_KEY in meta else None


FOOTER_READERS = 16  # footers read at once from an object store: each read waits on a round trip


def footers(paths: list[Path]) -> list[tuple[int, dict[str, int], str | None]]:
    """`footer_identity` of every path, in order; concurrently on an object store (a stage of a
    few hundred parts otherwise waits for hundreds of round trips one after another)."""
    if len(paths) < 2 or store_of(paths[0]).local:
        return [footer_identity(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(FOOTER_READERS, len(paths))) as pool:
        return list(pool.map(footer_identity, paths))


def read_complete(sdir: Path, schema: pa.Schema, columns: list[str] | None = None) -> pa.Table:
    """All rows of a complete folder, in part order, schema-checked."""
    src = current(sdir)
    m = manifest(src)
    if m is None:
        raise StageError(f"{sdir}: stage is not complete (no {MANIFEST}); run it first")
    tables = []
    for p in m["parts"]:
        t = read_part(src / p["file"], schema, columns)
        if t.num_rows != p["rows"]:
            raise SchemaError(
                f"{sdir / p['file']}: has {t.num_rows} rows, its stage's {MANIFEST} lists {p['rows']}; "
                f"the file was changed after the stage completed: redo it with {layout.redo_command(sdir)}"
            )
        tables.append(t)
    if not tables:
        return schema.empty_table() if columns is None else schema.empty_table().select(columns)
    table = pa.concat_tables(tables, promote_options="permissive")
    check_values(table, str(sdir))
    return table


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_fingerprint(path: str | Path) -> str:
    """Content hash of a file, or of every file below a directory (names, sizes, bytes)."""
    p = run_path(path)
    h = hashlib.sha256()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for q in files:
        h.update(str(q.relative_to(p) if p.is_dir() else q.name).encode())
        with q.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


# Where an input is, not what it is: the paths of prompt sets and models (their content hashes
# are in the inputs). Two processes that read the same prompts and models from different paths
# (fan-out ranks on machines of their own, a store URI and a local copy) agree.
LOCATIONS = (
    ("generate", "prompts"),
    ("eval", "prompts"),
    ("", "policy_model"),
    ("", "ref_model"),
    ("", "reward_model"),
    ("score", "teacher_model"),
)
HASHES = ("content", "sha256")  # a model fingerprint's content hash (store/modeldir.py)


def _located(identity: dict[str, Any]) -> Any:
    """The identity without where its prompt sets and models are (LOCATIONS in the config; the
    path of each model fingerprint of the inputs that holds a content hash)."""
    config = json.loads(json.dumps(identity.get("config") or {}, default=str))
    for table, key in LOCATIONS:
        node = config.get(table) if table else config
        if isinstance(node, dict):
            node.pop(key, None)
    return {
        "config": config,
        "inputs": _walk(identity.get("inputs"), _unplaced),
        "schema_version": identity.get("schema_version"),
    }


def _walk(obj: Any, fix: Any) -> Any:
    """`obj` with `fix` applied to every dict in it, innermost first."""
    if isinstance(obj, dict):
        return fix({k: _walk(v, fix) for k, v in obj.items()})
    if isinstance(obj, list):
        return [_walk(v, fix) for v in obj]
    return obj


def _unplaced(d: dict[str, Any]) -> dict[str, Any]:
    """A model fingerprint with a content hash, without its path (and hub revision)."""
    if "weights" in d and any(h in d for h in HASHES):
        return {k: v for k, v in d.items() if k not in ("path", "hub")}
    return d


def _unhashed(d: dict[str, Any]) -> dict[str, Any]:
    """A model fingerprint as versions before base-model hashes recorded it (no `sha256`)."""
    return {k: v for k, v in d.items() if k != "sha256"} if "weights" in d else d


def located_key(identity: dict[str, Any]) -> str:
    """The key of an identity but for where its prompt sets are: equal for `same_identity`s."""
    return fingerprint(_located(identity))


def same_identity(recorded: dict[str, Any], key: str, identity: dict[str, Any]) -> bool:
    """Whether a manifest or `_started.json` (`recorded`) has this identity: the same key (or the
    key this identity had before base models were hashed), or the same identity but for where
    the inputs are (`_located`)."""
    if recorded.get("key") == key:
        return True
    if recorded.get("key") == fingerprint(_walk(identity, _unhashed)):  # written before base-model hashes
        return True
    return located_key(recorded) == located_key(identity)


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


class StaleParts(StageError):
    """A commit found a part `path` that another identity wrote (a fan-out: its rank is still to
    redo it; on a store: a late upload of a command that lost the run lock)."""

    def __init__(self, path: Path, line: str):
        super().__init__(line)
        self.path = path


def write_manifest(
    sdir: Path,
    folder: str,
    n_parts: int,
    key: str,
    identity: dict,
    extra: dict | None,
    exclusive: bool = False,
    known: dict[str, tuple[int, dict]] | None = None,
    located: str | None = None,
) -> dict[str, Any]:
    """Check that parts 0..n_parts-1 are on disk, then write the manifest (last) and drop `_started`.
    `known`: (rows, counts) by part name of the parts this process wrote (their footers are not
    read back: on an object store each is a round trip); the others' are read from their footers,
    and refused when they record another identity than `located` (a rank of an earlier run)."""
    by_n: dict[int, Path] = {}
    for p in list_parts(sdir):
        by_n.setdefault(part_number(p), p)
    missing = [n for n in range(n_parts) if n not in by_n]
    if missing:
        raise StageError(f"{sdir}: parts {missing[:5]} are missing; re-run the stage to finish them")
    parts: list[dict[str, Any]] = []
    counts = _Counter()
    paths = [by_n[n] for n in range(n_parts)]
    known = known or {}
    read = dict(zip(unknown := [p for p in paths if p.name not in known], footers(unknown), strict=True))
    for path, (_, _, theirs) in read.items():
        if located and theirs and theirs != located:
            raise StaleParts(
                path,
                f"{path}: written with another config or inputs (by a rank of an earlier run): "
                "run its rank with --force",
            )
    for path in paths:
        rows, part = known[path.name] if path.name in known else read[path][:2]
        parts.append({"file": path.name, "rows": rows})
        counts.add(part)
    m = {
        "stage": folder,
        "key": key,
        **identity,
        "parts": parts,
        "rows": sum(p["rows"] for p in parts),
        "counts": dict(counts),
        "versions": dict(_versions()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),
    }
    guard(sdir / MANIFEST, commit=True)  # on a store: the run lock is still this command's
    if exclusive and not write_json_exclusive(sdir / MANIFEST, m):
        return read_json(sdir / MANIFEST)  # another process committed first: its manifest stands
    if not exclusive:
        write_json_atomic(sdir / MANIFEST, m)
    guard(sdir / STARTED)  # a holder paused since the commit's check writes nothing more
    (sdir / STARTED).unlink(missing_ok=True)
    return m


class _Counter(dict):
    def add(self, other: dict[str, int]) -> None:
        for k, v in other.items():
            self[k] = self.get(k, 0) + v


@functools.cache  # read from the installed metadata once per process (a stage run parses it)
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("rlhf-batch", "torch", "transformers", "pyarrow", "duckdb"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


def written_by(m: dict[str, Any]) -> str | None:
    """The command that wrote a manifest (recorded since the stage interface; before it, only an
    import is recognisable, by its config)."""
    if "command" in m:
        return str(m["command"])
    return "import" if "import" in (m.get("config") or {}) else None
