"""Atomic training checkpoints: weights, optimizer, RNG and data position; nothing is unpickled.

    <root>/step-00000012/model.safetensors   weights (safetensors save_model: tied weights ok)
                         optimizer.safetensors + optimizer.json   optimizer state (optim_state.py)
                         rng.safetensors     torch CPU (and CUDA) RNG states
                         state.json          next step, stage key, metrics rows so far

A checkpoint is written to a hidden temporary directory, fsynced and renamed to `step-N`; only
then are older ones removed, so a kill at any moment leaves at least one whole checkpoint (or
none, before the first). Readers take the highest `step-N`; temporary directories are ignored.
The learning-rate schedule is a pure function of the step, so `next_step` is its state, and
the training data plan is a pure function of the data and seed, so it is the data position too.

Under FSDP (train.fsdp) the weights and optimizer state are sharded over the ranks: every rank
takes part in `gather`, rank 0 writes the full state dicts it returns (the optimizer's keyed by
parameter name), and on resume every rank reads the files and keeps its own shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_batch.errors import StageError
from rlhf_batch.models import optim_state
from rlhf_batch.store import fs, layout


def gather(model: Any, optimizer: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective, on every rank of a sharded model: its full model and optimizer state dicts on
    rank 0's CPU (empty dicts on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    return weights, get_optimizer_state_dict(model, optimizer, options=opts) if optimizer else {}


def save(
    root: Path,
    step: int,
    model: Any,
    optimizer: Any,
    state: dict[str, Any],
    full: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> Path:
    """Write checkpoint `step` (the number of optimizer steps done) and drop older ones; `full`:
    the state dicts `gather` returned on rank 0, written instead of `model` and `optimizer`."""
    import torch
    from safetensors.torch import save_file, save_model

    from rlhf_batch.store.atomic import write_dir_atomic

    def write(tmp: Path) -> None:
        if full is None:
            save_model(model, str(tmp / "model.safetensors"))
        else:
            save_file(full[0], str(tmp / "model.safetensors"))
        optim = optimizer.state_dict() if full is None else full[1]
        optim_state.save(tmp, optim, optim_state.param_names(model), {})
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, str(tmp / layout.CHECKPOINT_RNG))
        (tmp / layout.CHECKPOINT_STATE).write_text(json.dumps({**state, "next_step": step}, indent=1))

    fs.makedirs(root)
    final = root / f"{layout.CHECKPOINT_PREFIX}{step:08d}"
    write_dir_atomic(final, write)
    for old in root.iterdir():
        if old != final:
            fs.remove(old)
    return final


def latest(root: Path) -> Path | None:
    dirs = sorted(p for p in root.glob(f"{layout.CHECKPOINT_PREFIX}*") if p.is_dir()) if root.is_dir() else []
    return dirs[-1] if dirs else None


def load_latest(
    root: Path, model: Any, optimizer: Any, key: str, device: Any, sharded: bool = False
) -> dict[str, Any] | None:
    """Restore the newest checkpoint into `model` and `optimizer`; returns its state or None.
    `sharded`: they are FSDP-sharded and the files hold full state dicts (written from `gather`)."""
    import torch
    from safetensors.torch import load_file, load_model

    path = latest(root)
    if path is None:
        return None
    path = fs.local_dir(path)  # a checkpoint on the object store: its local copy
    try:
        state: dict[str, Any] = json.loads((path / layout.CHECKPOINT_STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(
            f"{path}: unreadable checkpoint state ({e}); start over with {layout.redo_command(path, 'train')}"
        ) from None
    if state.get("key") != key:
        raise StageError(
            f"{path}: checkpoint of another config or input; start over with {layout.redo_command(path, 'train')}"
        )
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = StateDictOptions(full_state_dict=True)  # each rank keeps its shard of the full tensors
        weights: dict[str, Any] = load_file(str(path / "model.safetensors"))
        set_model_state_dict(model, weights, options=full)
    else:
        load_model(model, str(path / "model.safetensors"), device=str(device))
    optim_state.restore(path, model, optimizer, sharded)
    rng = load_file(str(path / layout.CHECKPOINT_RNG))
    torch.set_rng_state(rng["cpu"])
    cuda = [rng[f"cuda{i}"] for i in range(len(rng) - 1) if f"cuda{i}" in rng]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return state


def remove(root: Path) -> None:
    fs.remove(root)
