"""The LR schedule's length, fixed once per run in a run-level record: RUN_DIR/schedule.json.

The first train of the run that takes steps fixes it: `train.total_steps`, or when 0,
`iterations` x that iteration's number of steps. Every later iteration reads it from the record,
so a stage command run with `iterations` left at its default cannot shorten the schedule of a
run. Setting `train.total_steps` to another value later changes the length from the next
iteration that trains on (`run --set train.total_steps=N` extends a run): the record keeps each
change with the iteration it starts at, so complete iterations stay complete.

With a decaying schedule (`lr_schedule` linear or cosine) the length decides train's result, so
train's identity holds it as `train.total_steps`: the configured value or "I iterations" at the
iteration that fixes it, the record's value after. An iteration that would start past the end of
a decaying schedule (every step at lr 0) is refused, naming the record and the key to set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_batch.config import Config
from rlhf_batch.errors import StageError
from rlhf_batch.store import atomic, layout, manifests
from rlhf_batch.store.fs import run_path


def record_path(cfg: Config) -> Path:
    return run_path(cfg.run_dir) / layout.SCHEDULE


def read(cfg: Config) -> dict[str, Any] | None:
    path = record_path(cfg)
    if not path.is_file():
        return None
    rec = manifests.read_json(path)
    if not isinstance(rec, dict) or not isinstance(rec.get("total_steps"), int):
        raise StageError(f"{path}: not a schedule record (no whole-number 'total_steps')")
    return rec


def _fixing(cfg: Config, rec: dict[str, Any] | None, iteration: int, force: bool) -> bool:
    """Whether train `iteration` fixes the length (no record yet, or it is the iteration that
    fixed it, redone with --force)."""
    return rec is None or iteration < rec["fixed_at"] or (force and iteration == rec["fixed_at"])


def _at(rec: dict[str, Any], iteration: int) -> tuple[int, Any]:
    """(length, identity value) in force at `iteration` per the record."""
    total, ident = rec["total_steps"], rec["identity"]
    for change in rec.get("changed", []):
        if iteration >= change["from_iteration"]:
            total = ident = change["total_steps"]
    return total, ident


def _changes_here(cfg: Config, rec: dict[str, Any], iteration: int, force: bool) -> bool:
    """A set train.total_steps that differs from the record, for an iteration not yet complete."""
    set_to = cfg.train.total_steps
    done = manifests.manifest(layout.folder(cfg.run_dir, iteration, layout.TRAIN)) is not None
    return bool(set_to) and set_to != _at(rec, iteration)[0] and (force or not done)


def identity(cfg: Config, iteration: int, force: bool) -> Any:
    """The value of `train.total_steps` in train `iteration`'s identity."""
    tc = cfg.train
    if tc.lr_schedule == "constant":
        return tc.total_steps  # the length changes nothing
    rec = read(cfg)
    if _fixing(cfg, rec, iteration, force):
        if rec is None and not force and _written_before_the_record(cfg, iteration):
            return tc.total_steps  # a run written before the record: its folders stay complete
        return tc.total_steps or f"{cfg.iterations} iterations"
    assert rec is not None
    return tc.total_steps if _changes_here(cfg, rec, iteration, force) else _at(rec, iteration)[1]


def _written_before_the_record(cfg: Config, iteration: int) -> bool:
    m = manifests.manifest(layout.folder(cfg.run_dir, iteration, layout.TRAIN))
    return (
        m is not None and (m.get("config") or {}).get("train", {}).get("total_steps") == cfg.train.total_steps
    )


def check_not_ended(cfg: Config, iteration: int, global_step: int, force: bool) -> None:
    """Refuse an iteration that starts at or past the end of a decaying schedule (lr 0 throughout)."""
    rec = read(cfg)
    if cfg.train.lr_schedule == "constant" or _fixing(cfg, rec, iteration, force):
        return
    assert rec is not None
    changing = _changes_here(cfg, rec, iteration, force)
    total = cfg.train.total_steps if changing else _at(rec, iteration)[0]
    if global_step >= total:
        raise StageError(
            f"train iteration {iteration}: the run's {cfg.train.lr_schedule} LR schedule ended at step "
            f"{total} ({record_path(cfg)}) and this iteration starts at step {global_step}: it would train "
            "at lr 0; set train.total_steps to the run's new length to extend it"
        )


def length(
    cfg: Config, iteration: int, steps: int, force: bool, carried: int | None
) -> tuple[int, dict[str, Any] | None]:
    """(the schedule's length for train `iteration`, which takes `steps` steps; the record to
    write once it is complete, or None). `carried`: the length in an optimizer state written
    before the record existed."""
    rec = read(cfg)
    tc = cfg.train
    if rec is None and carried:
        rec = {"fixed_at": 0, "total_steps": carried, "identity": carried, "changed": []}
    if _fixing(cfg, rec, iteration, force):
        total = tc.total_steps or cfg.iterations * steps
        ident = tc.total_steps or f"{cfg.iterations} iterations"
        return total, {"fixed_at": iteration, "total_steps": total, "identity": ident, "changed": []}
    assert rec is not None
    if _changes_here(cfg, rec, iteration, force):
        kept = [c for c in rec.get("changed", []) if c["from_iteration"] < iteration]
        rec = {**rec, "changed": [*kept, {"from_iteration": iteration, "total_steps": tc.total_steps}]}
        return tc.total_steps, rec
    return int(_at(rec, iteration)[0]), None


def write(cfg: Config, rec: dict[str, Any] | None) -> None:
    """Rank 0, as train's output is complete: the record `length` returned."""
    if rec is not None:
        atomic.write_json_atomic(record_path(cfg), rec)
