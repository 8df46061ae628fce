"""Where a prompt set comes from (`generate.prompts`, `eval.prompts`), read into one Arrow table.

A prompt set is one of, or a list of (read in order and concatenated, as verl's `train_files`):

* a file: JSONL, a JSON array, Parquet;
* a Hugging Face `datasets` directory (`save_to_disk`; a DatasetDict's `train` split);
* a directory of shards: every .parquet / .jsonl / .json file below it, in name order;
* a glob (`data/train-*.parquet`), its matches in name order;
* any of these on an object store (`s3://bucket/prompts.jsonl`, a prefix of shards, a glob;
  a datasets directory through the local cache of store folders), read with the store's
  credentials from the environment as the run directory is;
* a hub dataset id, `org/name[@revision][:split]` (split default `train`), read from the local
  Hugging Face cache only (HF_HUB_CACHE / HF_HOME): the snapshot's files of that split (in a
  folder named after it, or named `<split>-*` / `<split>.*`). A dataset not in the cache is an
  error saying how to fetch it. As for models, a path whose first part is an existing directory
  is a local path, never a hub id.

The rows of a list are numbered in order over its files (errors name those row numbers).
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlhf_batch.errors import StageError
from rlhf_batch.runtime.hub import is_hub_dataset
from rlhf_batch.store.fs import filesystem, get_bytes, key, local_dir, retry, run_path, scheme, store_of

SUFFIXES = (".parquet", ".jsonl", ".json")


def describe(spec: Any) -> str:
    """The prompt set as messages name it."""
    return (
        spec
        if isinstance(spec, str)
        else ", ".join(str(x["path"] if isinstance(x, dict) else x) for x in spec)
    )


def sources(spec: Any, key: str = "generate.prompts") -> list[Path]:
    """The files (or datasets directories) of a prompt set, in reading order."""
    items = [spec] if isinstance(spec, str) else list(spec or [])
    items = [x.get("path", "") if isinstance(x, dict) else x for x in items]  # a weighted mixture's sources
    if not items or not all(items):
        raise StageError(f"{key}: no prompt file configured")
    return [p for item in items for p in _expand(str(item))]


def _expand(item: str) -> list[Path]:
    if scheme(item):  # a store URI: its object, or the objects below its prefix
        return _expand_remote(item)
    p = Path(item).expanduser()
    if p.is_dir() and not _is_datasets_dir(p):
        shards = sorted(
            q for q in p.rglob("*") if q.is_file() and q.suffix in SUFFIXES and q.name[0] not in "._"
        )
        if not shards:
            raise StageError(f"{p}: a directory without .parquet, .jsonl or .json files (nor a datasets dir)")
        return shards
    if p.exists():
        return [p]
    if any(c in item for c in "*?["):
        found = sorted(Path(x) for x in glob.glob(str(p), recursive=True) if Path(x).is_file())
        if not found:
            raise StageError(f"{item}: the pattern matches no prompt file")
        return found
    if not p.is_absolute() and is_hub_dataset(item):
        return hub_dataset_files(item)
    raise StageError(f"{p}: prompt file not found")


def _expand_remote(item: str) -> list[Path]:
    """The sources of a prompt set on a store (s3://...): one object, the shards below a prefix
    (a datasets dir is read through the local cache), or the objects a glob matches."""
    p = run_path(item, "prompts")
    fsys = filesystem(p)
    if any(c in item for c in "*?["):
        matches = retry(p, lambda: fsys.glob(key(p)))
        found = [
            run_path(fsys.unstrip_protocol(k), "prompts") for k in sorted(matches) if k.endswith(SUFFIXES)
        ]
        if not found:
            raise StageError(f"{item}: the pattern matches no prompt file")
        return found
    if retry(p, lambda: fsys.isfile(key(p))):
        return [p]
    if not retry(p, lambda: fsys.isdir(key(p))):
        raise StageError(f"{item}: prompt file not found")
    if _is_datasets_dir(p):
        return [p]
    shards = sorted(q for q in p.rglob("*") if q.suffix in SUFFIXES and q.name[0] not in "._")
    if not shards:
        raise StageError(f"{item}: a directory without .parquet, .jsonl or .json files (nor a datasets dir)")
    return shards


def _is_datasets_dir(p: Path) -> bool:
    return any((p / name).is_file() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))


def hub_dataset_files(spec: str) -> list[Path]:
    """The files of split `split` of hub dataset `org/name[@revision][:split]` in the HF cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from rlhf_batch.runtime.hub import hub_cache

    repo, _, split = spec.partition(":")
    repo, _, revision = repo.partition("@")
    split = split or "train"
    try:
        root = Path(
            snapshot_download(
                repo,
                repo_type="dataset",
                revision=revision or None,
                cache_dir=hub_cache(),
                local_files_only=True,
            )
        )
    except LocalEntryNotFoundError:
        rev = f" --revision {revision}" if revision else ""
        raise StageError(
            f"{spec}: not a local path and not a dataset in the Hugging Face cache ({hub_cache()}); datasets are "
            f"read from the cache only: fetch it with `hf download {repo} --repo-type dataset{rev}` (same HF_HOME)"
        ) from None
    files = sorted(
        q for q in root.rglob("*") if q.suffix in SUFFIXES and _in_split(q.relative_to(root), split)
    )
    if not files:
        raise StageError(
            f"{spec}: the cached dataset {root} has no .parquet/.jsonl/.json files of split {split!r}"
        )
    return files


def _in_split(rel: Path, split: str) -> bool:
    return split in rel.parts[:-1] or rel.name.startswith((f"{split}-", f"{split}."))


def read_prompt_table(spec: Any) -> pa.Table:
    """Every source of the prompt set, read and concatenated in order; errors name the file."""
    paths = sources(spec)
    return concat(paths, [read_file(p) for p in paths])


def concat(paths: list[Path], tables: list[pa.Table]) -> pa.Table:
    """The tables of the sources `paths`, in order, as one; a source whose columns do not fit is named."""
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        bad = next((p for p, t in zip(paths, tables, strict=True) if t.schema != tables[0].schema), paths[-1])
        raise StageError(
            f"{bad}: its columns do not match those of {paths[0]} ({str(e).splitlines()[0]})"
        ) from None


def fingerprint(spec: Any) -> str:
    """The content hash of a prompt set (one source: that of the file, as before lists)."""
    from rlhf_batch.store.manifests import file_fingerprint

    paths = sources(spec)
    if len(paths) == 1:
        return file_fingerprint(paths[0])
    h = hashlib.sha256("\n".join(f"{p.name}:{file_fingerprint(p)}" for p in paths).encode())
    return h.hexdigest()[:16]


def read_file(p: Path) -> pa.Table:
    """One prompt file (or datasets dir) as an Arrow table, local or on a store (an object read
    whole: one GET; a datasets dir: its local cached copy); errors name the file."""
    try:
        if p.is_dir():
            return _read_datasets_dir(local_dir(p))
        if p.suffix not in SUFFIXES:
            raise StageError(f"{p}: unknown prompt file type (use a datasets dir, .jsonl, .json or .parquet)")
        with pa.OSFile(str(p)) if store_of(p).local else pa.BufferReader(get_bytes(p)) as src:
            if p.suffix == ".json" and src.read(4096).lstrip().startswith(b"["):
                src.seek(0)
                return _json_rows(p, src.read())
            src.seek(0)
            if p.suffix == ".parquet":
                import pyarrow.parquet as pq

                return pq.read_table(src)
            import pyarrow.json as pj

            return _utf8(p, pj.read_json(src)) if src.size() else pa.table({})
    except (pa.ArrowInvalid, OSError) as e:
        raise StageError(f"{p}: cannot read prompts ({str(e).splitlines()[0]})") from None


def _utf8(p: Path, t: pa.Table) -> pa.Table:
    """`t` when its text is valid UTF-8 (Arrow's JSON reader does not check strings)."""
    try:
        t.validate(full=True)
    except pa.ArrowInvalid:
        raise StageError(f"{p}: not UTF-8 text (JSON Lines must be UTF-8)") from None
    return t


def _json_rows(p: Path, data: bytes) -> pa.Table:
    """A .json file holding one JSON array of objects."""
    import json

    try:
        rows = json.loads(data.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StageError(f"{p}: not valid JSON ({e})") from None
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise StageError(f"{p}: item {bad} of the JSON array is not an object")
    try:
        return pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise StageError(f"{p}: cannot read prompts ({str(e).splitlines()[0]})") from None


def _read_datasets_dir(p: Path) -> pa.Table:
    from datasets import Dataset, DatasetDict, load_from_disk

    ds = load_from_disk(str(p))
    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise StageError(f"{p}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    assert isinstance(ds, Dataset)
    return ds.flatten_indices().data.table
