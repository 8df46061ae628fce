"""The executor: the one place that runs a stage (stages/base.py) over its output folder.

It alone owns what every stage has in common:

* refusal: a folder complete (or partial) with another identity (config, input fingerprints,
  schema version) is refused with the keys that differ; `--force` writes the new output beside
  the old one and swaps it in once complete (store/staging.py): what fails or is killed before
  that leaves the old output as it was;
* resume: only the parts not on disk are written; a complete folder is left as it is;
* ranks: rank r writes the missing parts n with n % world == r (rank 0 all of them for a
  single-writer stage);
* progress: one bar per stage run, on rank 0, unless quiet;
* timing: start-up, work and tokens (timing.py), the manifest's `timing` entry;
* the manifest, written last by rank 0 once every part is on disk.

A part is written to a hidden temporary name, fsynced and renamed (atomic.py), so a reader never
sees half a file; a re-run ends with exactly the rows of an uninterrupted run.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rlhf_batch.errors import StageError
from rlhf_batch.observe import tracking
from rlhf_batch.runtime import dist
from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.runtime.timing import StageClock
from rlhf_batch.store import layout, redo, staging
from rlhf_batch.store.atomic import set_durable
from rlhf_batch.store.manifests import (
    manifest,
    same_identity,
    written_by,
)
from rlhf_batch.store.output import StageOutput

if TYPE_CHECKING:
    from rlhf_batch.stages.base import Stage


def output_of(stage: Stage) -> StageOutput:
    """The output folder of `stage`, with its identity and inputs: prepares the stage (once per
    `execute` or `is_done`), then asks its questions."""
    stage.prepare()
    return StageOutput(
        stage.sdir, stage.folder, stage.identity(), stage.inputs(), stage.cfg.to_dict(), stage.name
    )


def execute(
    stage: Stage, *, force: bool = False, quiet: bool = False, since: float | None = None
) -> dict[str, Any]:
    """Run `stage` to completion (or see it is complete); returns its manifest. Its start-up
    counts from `since` (a `time.monotonic` value: the stage commands give the process start),
    by default from this call."""
    stage.force = force
    clock = StageClock(since)
    set_durable(stage.cfg.fsync)
    if dist.rank_world()[0] == 0:
        staging.recover_folder(stage.sdir)  # a swap a kill interrupted
    out = None
    try:
        out = output_of(stage)
        out.clock = stage.clock = clock
        if not force and (m := out.done()) is not None:
            _tidy(stage, out)
            return m
        stage.load()
        stage.check()
        if force:
            _stage_beside(stage, out)
        out.begin(force)
        n_parts = stage.plan()
        todo = out.todo(n_parts, stage.single_writer)
        _say_resumed(stage, out, n_parts, quiet)
        if todo:
            stage.open(todo)
        if clock.work_start is None:  # unless the stage marked it (earlier)
            clock.work_begins()
        with _progress(stage, todo, quiet or not dist.leads()) as bar:
            stage.write_parts(todo, out, bar)
        result = out.finish(n_parts, _manifest_extra(stage, force))  # under --force: swapped in
        stage.staging = None
        if result is not None:  # rank 0: the live trackers (report_to); never raises
            tracking.log_stage(out.record, stage.sdir, result)
        fault_point(f"{stage.folder}:manifest:done")
        _tidy(stage, out)
        return result or manifest(stage.sdir) or {}
    finally:
        _unstage(stage, out)
        stage.close()


def _manifest_extra(stage: Stage, force: bool) -> Any:
    """The stage's manifest entries; a stage `run --redo-from` forces also records its token."""
    token = os.environ.get(redo.ENV) if force else None
    if not token:
        return stage.manifest_extra
    return lambda: {**stage.manifest_extra(), "redo": token}


def _stage_beside(stage: Stage, out: StageOutput) -> None:
    """--force: the stage writes into the staging folder beside its output (store/staging.py)."""
    where = out.stage_beside()
    stage.staging = where if out.final != where else None


def _unstage(stage: Stage, out: StageOutput | None) -> None:
    stage.staging = None
    if out is None:
        return
    out.close()  # uploads still in flight
    if out.final != out.sdir and out.rank == 0:
        staging.drop_if_empty(out.sdir)  # a forced run that failed before its first part


def is_done(stage: Stage) -> bool:
    """Whether `run` may skip `stage`: its folder is complete with the stage's identity and inputs,
    or was written on purpose by another stage (rollouts imported instead of generated). A stage
    whose inputs are not there, or whose folder differs, is not done: running it says why."""
    m = manifest(stage.sdir)
    if m is None:
        return False
    if written_by(m) not in (None, stage.name):
        return True
    try:
        out = output_of(stage)
    except StageError:
        return False
    if not same_identity(m, out.key, out.identity):
        return False
    _tidy(stage, out)
    return True


def _say_resumed(stage: Stage, out: StageOutput, n_parts: int, quiet: bool) -> None:
    """One line when parts of an interrupted run are on disk and only the others are redone."""
    on_disk = len({layout.part_number(p) for p in layout.list_parts(out.sdir)} & set(range(n_parts)))
    if on_disk and on_disk < n_parts and out.rank == 0 and not quiet:
        import sys

        rnd = f" top-up round {stage.topup}" if stage.topup else ""
        print(
            f"{stage.name} iteration {stage.iteration}{rnd}: resuming, {on_disk} of {n_parts} parts already on disk",
            file=sys.stderr,
            flush=True,
        )


def _tidy(stage: Stage, out: StageOutput) -> None:
    if out.rank == 0:
        stage.on_complete()


def _progress(stage: Stage, todo: list[int], disable: bool) -> Any:
    from rlhf_batch.runtime.progress import progress_bar

    return progress_bar(
        total=stage.progress_total(todo),
        unit=stage.unit,
        unit_scale=stage.unit_scale,
        desc=stage.progress_desc,
        disable=disable,
        dynamic_ncols=True,
    )
