"""Checks and ids shared by the two kinds of `import` rows: (prompt, response) rows (importer.py)
and chat-message trajectories (import_messages.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlhf_batch.errors import SchemaError
from rlhf_batch.store.ids import prompt_hash, rollout_id
from rlhf_batch.store.schemas import ROLLOUTS

GIVEN = ("response_ids", "behavior_logprobs")  # an external engine's tokens and log-probs
COMPUTED = set(ROLLOUTS.names) - {"prompt", "response", "prompt_id", "finish_reason", *GIVEN}


def add_ids(t: pa.Table, prompts: list[str], path: Path, iteration: int) -> pa.Table:
    """rollout_id, prompt_id (given, else the hash of `prompts`), sample_idx and finish_reason."""
    given = (
        t["prompt_id"].cast(pa.string()).to_pylist()
        if "prompt_id" in t.column_names
        else [None] * len(prompts)
    )
    ids = [g if g is not None else prompt_hash(p) for g, p in zip(given, prompts, strict=True)]
    first: dict[str, tuple[int, str]] = {}
    seen: dict[str, int] = {}
    sample_idx = []
    for row, (pid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        r0, p0 = first.setdefault(pid, (row, prompt))
        if p0 != prompt:
            raise SchemaError(
                f"{path}: prompt_id {pid!r} has different prompts in rows {r0 + 1} and {row + 1}"
            )
        sample_idx.append(seen.get(pid, 0))
        seen[pid] = sample_idx[-1] + 1
    finish = ["stop"] * len(prompts)
    if "finish_reason" in t.column_names:
        finish = [f or "stop" for f in t["finish_reason"].cast(pa.string()).to_pylist()]
        bad = [i for i, f in enumerate(finish) if f not in ("stop", "length")]
        if bad:
            raise SchemaError(
                f"{path}: column 'finish_reason' is {finish[bad[0]]!r} in row {bad[0] + 1}; "
                "expected 'stop' or 'length'"
            )
    out = t.drop_columns([c for c in ("prompt_id", "finish_reason") if c in t.column_names])
    out = out.append_column(
        "rollout_id", pa.array([rollout_id(iteration, p, k) for p, k in zip(ids, sample_idx, strict=True)])
    )
    out = out.append_column("prompt_id", pa.array(ids, pa.string()))
    out = out.append_column("sample_idx", pa.array(sample_idx, pa.int32()))
    return out.append_column("finish_reason", pa.array(finish, pa.string()))


def no_nulls(col: pa.ChunkedArray, path: Path, name: str) -> None:
    """No null in the column, nor inside a list of it (errors name the row, 1-based)."""
    if col.null_count:
        row = pc.index(col.is_null(), True).as_py()
        raise SchemaError(f"{path}: column '{name}' is null in row {row + 1}")
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        inner = pc.list_flatten(col)
        if inner.null_count:
            row = pc.list_parent_indices(col)[pc.index(inner.is_null(), True).as_py()].as_py()
            raise SchemaError(f"{path}: column '{name}' holds a null value in row {row + 1}")


def check_given_ids(response_ids: list[list[int]], rid: list[str], vocab: int, where: str) -> None:
    for r, ids in zip(rid, response_ids, strict=True):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise SchemaError(
                f"{where}: rollout {r}: response_ids holds {bad[0]}, outside the policy's vocabulary [0, {vocab})"
            )


def check_given_logprobs(logps: list[Any], response_ids: list[list[int]], rid: list[str], where: str) -> None:
    for r, lp, ids in zip(rid, logps, response_ids, strict=True):
        if len(lp) != len(ids):
            raise SchemaError(
                f"{where}: rollout {r}: behavior_logprobs has {len(lp)} values for {len(ids)} response_ids"
            )
        low = float(np.finfo(np.float32).min)  # stored as float32: below it would be -inf
        if not np.isfinite(lp).all() or (lp > 0).any() or (lp < low).any():
            bad = next(x for x in lp.tolist() if not math.isfinite(x) or x > 0 or x < low)
            raise SchemaError(
                f"{where}: rollout {r}: behavior_logprobs holds {bad}; log-probs are finite float32 "
                "values <= 0"
            )


def positions_of(model: Any) -> int | None:
    """The positions the policy holds (its config's max_position_embeddings; None: unknown)."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def check_positions(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    rid: list[str],
    positions: int | None,
    where: str,
) -> None:
    """Refuse a rollout of more tokens than the policy's positions (score and train could not read it)."""
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        if positions and len(p) + len(r) > positions:
            raise SchemaError(
                f"{where}: rollout {rid[i]}: {len(p) + len(r)} tokens, more than the policy's {positions} "
                "positions (max_position_embeddings); shorten or drop it"
            )
