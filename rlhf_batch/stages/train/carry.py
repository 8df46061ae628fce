"""One optimizer for the run: train of iteration K continues from the AdamW state of K-1.

Train of iteration K ends by writing `iter=K/train/optimizer/` (optim_state.py: safetensors +
JSON) with, beside the AdamW moments and per-parameter step counts, the run's `global_step`
after K, the schedule's length `total_steps` and the schedule settings it ran with. Train of
K+1 loads it before its first step, so Adam's moments, its bias correction and the learning
rate schedule (warmup once, then the decay over the run's steps) run on as if one process had
trained every iteration. Iteration 0, or an iteration after one with no state, starts fresh.

Schedule length: fixed once per run in RUN_DIR/schedule.json (schedule.py).

Changing `train.lr`, `weight_decay`, `warmup_steps` or `lr_schedule` in the middle of a run is refused (naming the old and new values) unless `--force`: then the
iteration continues from the carried moments and global step with the new settings (the
schedule is evaluated at the run's global step with the new values; nothing is replayed), and
its train manifest records the change under `optimizer.changed`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_batch.config import Config
from rlhf_batch.errors import StageError
from rlhf_batch.models import optim_state
from rlhf_batch.store import atomic, layout, manifests
from rlhf_batch.store.fs import local_dir

SCHEDULE = ("lr", "weight_decay", "warmup_steps", "lr_schedule")


def previous(cfg: Config, iteration: int) -> tuple[Path, dict[str, Any]] | None:
    """(directory, JSON) of the optimizer state iteration `iteration - 1` ended with, checked;
    None at iteration 0, with `train.fresh_optimizer`, or after an iteration that wrote none. A
    state the previous train manifest says was written and that is not there is an error."""
    if iteration == 0 or cfg.train.fresh_optimizer:
        return None
    path = layout.optimizer_dir(cfg.run_dir, iteration - 1)
    meta = optim_state.read_meta(path)
    if meta is None:
        before = manifests.manifest(layout.folder(cfg.run_dir, iteration - 1, layout.TRAIN)) or {}
        if (before.get("optimizer") or {}).get("global_step"):  # it took steps and wrote their state
            raise StageError(
                f"{path}: the optimizer state of iteration {iteration - 1} is missing (train of iteration "
                f"{iteration} continues it); restore it, or set train.fresh_optimizer=true to start AdamW "
                "and the schedule afresh (recorded in the train manifest)"
            )
        return None
    optim_state.check(local_dir(path), meta)  # a state on the object store: its local copy
    return path, meta


def changes(cfg: Config, iteration: int, prev: dict[str, Any] | None, force: bool) -> dict[str, Any]:
    """The schedule settings that differ from the carried state's ({key: [old, new]}); an error
    naming them unless `force`."""
    if prev is None:
        return {}
    tc = cfg.train
    now = {k: getattr(tc, k) for k in SCHEDULE}  # the length: schedule.py
    diff = {k: [prev.get(k), v] for k, v in now.items() if prev.get(k) != v}
    if diff and not force:
        said = ", ".join(f"train.{k} {old!r} -> {new!r}" for k, (old, new) in diff.items())
        raise StageError(
            f"train iteration {iteration}: {said} since iteration {iteration - 1}, whose optimizer state "
            f"this iteration continues; `rlhf-batch train CONFIG --iter {iteration} --force` goes on from the "
            f"carried AdamW state and step "
            f"{prev.get('global_step')} with the new settings"
        )
    return diff


def record(
    start: int, end: int, total: int | None, carried_from: int | None, fresh: bool = False
) -> dict[str, Any]:
    """The train manifest's `optimizer` entry: the run's global steps before and after (`fresh`:
    train.fresh_optimizer asked to start afresh, recorded only then)."""
    return {
        "global_step_start": start,
        "global_step": end,
        "total_steps": total,
        "carried_from": carried_from,
        **({"fresh": True} if fresh else {}),
    }


def state_extra(cfg: Config, global_step: int, total: int, carried_from: int | None) -> dict[str, Any]:
    """The JSON written beside the AdamW tensors: where the run's schedule stands."""
    return {
        "global_step": global_step,
        "total_steps": total,
        "carried_from": carried_from,
        **{k: getattr(cfg.train, k) for k in SCHEDULE},
    }


def restore(trainer: Any, path: Path, weight_decay: float) -> None:
    """Load the carried state into the trainer's optimizer. load_state_dict also restores the
    saved hyper-parameters; weight decay is set back to the config's (lr is set every step)."""
    optim_state.restore(local_dir(path), trainer.model, trainer.optimizer, trainer.sharded)
    for group in trainer.optimizer.param_groups:
        group["weight_decay"] = weight_decay


def save(
    root: Path, state_dict: dict[str, Any], model: Any, extra: dict[str, Any], moments_dtype: str = "float32"
) -> None:
    """Rank 0: the end-of-iteration state, written atomically to `root`, its moments in
    `moments_dtype` (train.optimizer_state_dtype); kept in memory for the next iteration when
    this process keeps it (models/resident.py)."""
    import torch

    names = optim_state.param_names(model)
    dtype = None if moments_dtype == "float32" else getattr(torch, moments_dtype)
    extra = {**extra, "moments_dtype": moments_dtype} if dtype is not None else extra
    written: list[dict[str, Any]] = []
    atomic.write_dir_atomic(
        root, lambda tmp: written.append(optim_state.save(tmp, state_dict, names, extra, dtype))
    )
    optim_state.keep_written(root, written[-1])
