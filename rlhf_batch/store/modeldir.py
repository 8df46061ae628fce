"""Model directories as the run sees them: the checks every load goes through (a Hugging Face
directory with safetensors weights, not one that keep_policies removed) and the fingerprint a
stage records for a model it reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_batch.errors import ModelError
from rlhf_batch.runtime.hub import hub_revision
from rlhf_batch.store import layout
from rlhf_batch.store.fs import is_remote, run_path


def check_model_dir(path: str, what: str) -> Path:
    p = run_path(path) if path else Path(path)
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


def same_dir(a: str | Path | None, b: str | Path | None) -> bool:
    """Whether two model paths name the same directory (symlinks and `..` resolved locally)."""
    if not a or not b:
        return False
    pa, pb = run_path(a), run_path(b)
    if is_remote(pa) or is_remote(pb):
        return str(pa).rstrip("/") == str(pb).rstrip("/")
    return pa.resolve() == pb.resolve()


def refuse_removed(p: Path, what: str) -> None:
    if (gone := removed_record(p)) is not None:
        raise ModelError(
            f"{what}: {p} was removed by keep_policies on {gone['removed']}; it cannot be loaded"
        )


def model_fingerprint(path: str, what: str) -> dict[str, Any]:
    """What identifies a model for the stage manifests, cheaply: its path, config.json and the
    names and sizes of its weight files (weights are not hashed: models can be many GB). A policy
    that keep_policies removed keeps the fingerprint recorded before its removal."""
    if (gone := removed_record(path)) is not None:
        return dict(gone["fingerprint"])
    p = check_model_dir(path, what)
    weights = {q.name: q.stat().st_size for q in sorted(p.glob("*.safetensors"))}
    out = {"path": str(p), "config": (p / "config.json").read_text(), "weights": weights}
    hub = None if is_remote(p) else hub_revision(p)
    return {**out, "hub": hub} if hub else out


def removed_record(path: str | Path) -> dict[str, Any] | None:
    """The record of a policy dir that retention removed (None when it was not removed)."""
    import json

    p = run_path(path)
    record = p.parent / layout.POLICY_REMOVED
    if p.name != layout.POLICY_DIR or p.exists() or not record.is_file():
        return None
    data: dict[str, Any] = json.loads(record.read_text())
    return data
