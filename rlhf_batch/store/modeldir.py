"""Model directories as the run sees them: the checks every load goes through (a Hugging Face
directory with safetensors weights, not one that keep_policies removed) and the fingerprint a
stage records for a model it reads."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_batch.errors import ModelError
from rlhf_batch.runtime.hub import hub_revision
from rlhf_batch.store import layout
from rlhf_batch.store.fs import cache_root, local_dir, makedirs, run_path, store_of
from rlhf_batch.store.layout import BASE_WEIGHTS, WEIGHTS_DIGEST


def check_model_dir(path: str, what: str) -> Path:
    p = run_path(path, what) if path else Path(path)
    if not path:
        raise ModelError(f"{what}: no model directory configured")
    if not p.is_dir():
        refuse_removed(p, what)
        raise ModelError(f"{what}: model directory not found: {p}")
    if not (p / "config.json").is_file():
        raise ModelError(f"{what}: {p} has no config.json (not a Hugging Face model directory)")
    if not any(p.glob("*.safetensors")):
        raise ModelError(f"{what}: {p} has no *.safetensors weights (only safetensors are loaded)")
    return p


@contextlib.contextmanager
def config_dir(p: Path) -> Iterator[Path]:
    """A local folder holding the config of the model dir `p` (for transformers' AutoConfig):
    `p` itself where local; on a store, its config.json (and any remote code's .py files)
    copied to a temporary folder, the weights left where they are."""
    if store_of(p).local:
        yield p
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rlhf-batch-") as d:
        for q in [p / "config.json", *p.glob("*.py")]:
            (Path(d) / q.name).write_bytes(q.read_bytes())
        yield Path(d)


def same_dir(a: str | Path | None, b: str | Path | None) -> bool:
    """Whether two model paths name the same directory (symlinks and `..` resolved locally)."""
    if not a or not b:
        return False
    return str(run_path(a).resolve()) == str(run_path(b).resolve())  # a UPath resolves to itself


def refuse_removed(p: Path, what: str) -> None:
    if (gone := removed_record(p)) is not None:
        raise ModelError(
            f"{what}: {p} was removed by keep_policies on {gone['removed']}; it cannot be loaded"
        )


def model_fingerprint(path: str, what: str) -> dict[str, Any]:
    """What identifies a model for the stage manifests: its path, config.json, the names and
    sizes of its weight files and the content hash of its weights: for a policy this package
    wrote, the one stored beside them when written (`content`, WEIGHTS_DIGEST); for any other
    model (`sha256`, base_digest), hashed once per machine. Fan-out ranks whose copies of a model
    lie at different paths (or one on the store, one local) agree by that hash (store/manifests
    `same_identity`). A policy that keep_policies removed keeps the fingerprint recorded before
    its removal."""
    if (gone := removed_record(path)) is not None:
        return dict(gone["fingerprint"])
    p = check_model_dir(path, what)
    weights = {q.name: q.stat().st_size for q in sorted(p.glob("*.safetensors"))}
    out = {"path": str(p), "config": (p / "config.json").read_text(), "weights": weights}
    if (content := weights_digest(p)) is not None:
        out["content"] = content
    else:
        out["sha256"] = base_digest(p)
    hub = hub_revision(p) if store_of(p).local else None
    return {**out, "hub": hub} if hub else out


def base_digest(p: Path) -> str:
    """The content hash of the weights of the model dir `p` (a model the run did not write), by
    the formula of `weights_digest`: each weight file's sha256, read once per machine and file
    (kept in the local cache by the file's path, size and mtime); a model on a store is hashed
    in its local cached copy (fs.local_dir: downloaded once per machine, as loading it does)."""
    return _digest_key(_weight_hashes(local_dir(p), _file_sha256))


def _weight_hashes(p: Path, sha256: Any) -> dict[str, dict[str, Any]]:
    """Each weight file of the local model dir `p`: its size and `sha256(file)`."""
    return {q.name: {"bytes": q.stat().st_size, "sha256": sha256(q)} for q in sorted(p.glob("*.safetensors"))}


def _digest_key(digest: dict[str, Any]) -> str:
    """The content hash of a model from its weight files' hashes (WEIGHTS_DIGEST's content)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:16]


def _stamp(q: Path) -> dict[str, int]:
    """What changes whenever the bytes of the local file `q` may have: its size, mtime, inode and
    ctime (a file replaced with the same size and a restored mtime, `touch -d` or `cp -p`, has
    another ctime: the kernel sets it, no user can put it back)."""
    st = q.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _same_stamp(seen: dict[str, Any] | None, stamp: dict[str, int]) -> bool:
    return seen is not None and all(seen.get(k) == v for k, v in stamp.items())


def _file_sha256(q: Path) -> str:
    """The sha256 of the local file `q`, from the machine's record when its `_stamp` is the one
    recorded (cache_root()/../sha256, one small file per path); else read again."""
    import hashlib
    import json

    stamp = _stamp(q)
    record = (
        cache_root().parent
        / "sha256"
        / (hashlib.sha256(str(q.resolve()).encode()).hexdigest()[:32] + ".json")
    )
    try:
        seen = json.loads(record.read_text())
        if _same_stamp(seen, stamp):
            return str(seen["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    value = _sha256(q)
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**stamp, "sha256": value}))
    os.replace(tmp, record)
    return value


def write_weights_digest(p: Path) -> None:
    """Hash the weight files of the (local) model dir `p`, once, as it is written, into WEIGHTS_DIGEST."""
    import json

    (p / WEIGHTS_DIGEST).write_text(json.dumps(_weight_hashes(p, _sha256), indent=1, sort_keys=True))


def weights_digest(p: Path) -> str | None:
    """The content hash of the weights of `p` recorded in WEIGHTS_DIGEST; None when there is none
    or it does not describe the weight files there (names or sizes differ)."""
    import json

    path = p / WEIGHTS_DIGEST
    if not path.is_file():
        return None
    try:
        digest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    files = {q.name: q.stat().st_size for q in p.glob("*.safetensors")}
    if not isinstance(digest, dict) or {k: v.get("bytes") for k, v in digest.items()} != files:
        return None
    return _digest_key(digest)


def without_path(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A model's fingerprint but for where it is (and the base-model hash, which records of
    policies carried forward did not hold before it existed)."""
    return {k: v for k, v in fingerprint.items() if k not in ("path", "sha256")}


def carried_record(src: str | Path, dst: Path) -> dict[str, Any]:
    """The record (CARRIED_FROM) of the policy dir `dst` that train writes as a copy of the policy
    `src` (stages/train/empty.py): its source (as "{run_dir}/..." below the run directory) and
    that source's fingerprint, without its path."""
    return {
        "from": layout.portable(str(src), layout.run_root(dst)),
        "fingerprint": without_path(model_fingerprint(str(src), "policy")),
    }


def write_carried_from(out: Path, record: dict[str, Any]) -> None:
    """Into the (local, temporary) folder `out` of a policy being written: its `carried_record`."""
    import json

    (out / layout.CARRIED_FROM).write_text(json.dumps(record, indent=1))


def carried_from(p: Path) -> tuple[str, dict[str, Any]] | None:
    """(source, its fingerprint when copied) of the policy dir `p` when train copied it unchanged
    from another policy (CARRIED_FROM); None for any other model dir."""
    import json

    path = p / layout.CARRIED_FROM
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return str(rec["from"]).replace("{run_dir}", str(layout.run_root(p))), rec["fingerprint"]


def removed_record(path: str | Path) -> dict[str, Any] | None:
    """The record of a policy dir that retention removed (None when it was not removed)."""
    import json

    p = run_path(path)
    record = p.parent / layout.POLICY_REMOVED
    if p.name != layout.POLICY_DIR or p.exists() or not record.is_file():
        return None
    data: dict[str, Any] = json.loads(record.read_text())
    root = p.parent.parent.absolute()  # a UPath is absolute already
    fp = layout.unportable(data["fingerprint"], root)
    # a record written with absolute paths, before they were portable: the path is this one
    if isinstance(fp, dict) and str(fp.get("path", "")).endswith(f"/{p.parent.name}/{p.name}"):
        fp["path"] = str(p.absolute())
    return {**data, "fingerprint": fp}


def check_base_weights(run_dir: str | Path, path: str, what: str) -> None:
    """The weights of a model the run did not write (the initial policy, the reference) are those
    it began with: their sha256 is recorded in RUN_DIR/BASE_WEIGHTS the first time a stage reads
    them, with each file's `_stamp` (size, mtime, inode, ctime); later a file whose stamp is
    unchanged is not read again, and one whose bytes changed (same config) is refused with one
    line, not mixed. A model on a store is checked in its local copy (fs.local_dir, named by the
    objects' ETags): weights overwritten at the same address are refused as well."""
    p = check_model_dir(path, what)
    if removed_record(p) is not None:
        return
    from rlhf_batch.store.atomic import write_json_atomic
    from rlhf_batch.store.manifests import read_json

    record_path = run_path(run_dir) / BASE_WEIGHTS
    record = read_json(record_path) if record_path.exists() else {}
    where = str(p.resolve()) if store_of(p).local else str(p)
    was = record.get(where, {})
    now: dict[str, Any] = {}
    # a model on a store: its local copy, which is named by its objects' ETags (a new copy when
    # an object is overwritten at the same address)
    for q in sorted(local_dir(p).glob("*.safetensors")):
        stamp, seen = _stamp(q), was.get(q.name)
        now[q.name] = seen if _same_stamp(seen, stamp) else {**stamp, "sha256": _file_sha256(q)}
    if was and {k: v["sha256"] for k, v in was.items()} != {k: v["sha256"] for k, v in now.items()}:
        changed = sorted(
            k for k in {*was, *now} if (was.get(k) or {}).get("sha256") != (now.get(k) or {}).get("sha256")
        )
        raise ModelError(
            f"{what}: the weights of {p} changed since this run read them ({', '.join(changed)}; recorded in "
            f"{record_path}); a run uses one base model: put the weights back, or use a new run_dir"
        )
    if now != was:
        makedirs(record_path.parent)
        write_json_atomic(record_path, {**record, str(p.resolve()): now})


def _sha256(q: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(q, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
