"""`run --redo-from K[:STAGE]`: redo a stage of iteration K and everything downstream of it.

    RUN_DIR/_redo.json   {"from": [K, STAGE], "order": [stage names of one iteration], "token": T}

`run` writes this mark (under the run lock) before it runs anything, then runs the iterations as
always, but with `--force` for each stage at or after (K, STAGE), in the order (iteration, stage
in `order`), whose folder is complete and does not yet carry the mark's token: the forced run
writes beside the folder and swaps in at its commit (staging.py), and the new manifest records
`"redo": T`. So a kill anywhere resumes: what committed carries T and is skipped, a stage killed
before its commit had its old output untouched and is redone. Once every iteration is through,
`run` removes the mark. A stage whose new output is byte for byte the old one keeps the old
folder (staging.same_output) and so no token: after a kill it is redone once more, to the same.

Left alone: folders written by another stage (imported or replayed rollouts in `rollouts`), and
the top-up rounds an iteration took before (their rollouts and scores are redone where they are
downstream; the decision to take a round is not made again).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from rlhf_batch.errors import UserError
from rlhf_batch.store import fs, layout
from rlhf_batch.store.atomic import write_json_atomic
from rlhf_batch.store.manifests import read_json

FILE = "_redo.json"
ENV = "RLHF_BATCH_REDO"  # the token, in the environment of the stages `run` forces


def path(run_dir: str | Path) -> Path:
    return fs.run_path(run_dir) / FILE


def parse(spec: str, order: list[str]) -> tuple[int, str]:
    """`K` or `K:STAGE` -> (K, STAGE); `K` alone is the iteration's first stage."""
    it_text, _, stage = spec.partition(":")
    if not it_text.isdigit():
        raise UserError(f"--redo-from must be K or K:STAGE with K an iteration >= 0, got {spec!r}")
    stage = stage or order[0]
    if stage not in order:
        raise UserError(f"--redo-from {spec}: no stage {stage!r} in a run; stages: {', '.join(order)}")
    return int(it_text), stage


def read(run_dir: str | Path) -> dict[str, Any] | None:
    """The pending mark, or None."""
    p = path(run_dir)
    return read_json(p) if p.is_file() else None


def start(run_dir: str | Path, iteration: int, stage: str, order: list[str]) -> dict[str, Any]:
    """Write the mark (a pending one that starts earlier keeps its start point; either way a new
    token: every stage downstream is redone again)."""
    mark = {"from": [iteration, stage], "order": order, "token": uuid.uuid4().hex}
    before = read(run_dir)
    if before is not None and position(before, *before["from"]) < position(mark, iteration, stage):
        mark["from"] = before["from"]
    write_json_atomic(path(run_dir), mark)
    return mark


def finish(run_dir: str | Path) -> None:
    fs.remove(path(run_dir))


def position(mark: dict[str, Any], iteration: int, stage: str) -> tuple[int, int]:
    order = mark["order"]
    return iteration, order.index(stage) if stage in order else len(order)


def downstream(mark: dict[str, Any], iteration: int, stage: str) -> bool:
    """Whether stage `stage` of `iteration` is at or after the mark's start."""
    return position(mark, iteration, stage) >= position(mark, *mark["from"])


def pending(mark: dict[str, Any] | None, iteration: int, stage: str, m: dict[str, Any] | None) -> bool:
    """Whether `run` still has to redo the stage whose folder's manifest is `m`: downstream of
    the mark, complete, written by the stage itself, and not yet redone under this mark."""
    from rlhf_batch.store.manifests import written_by

    return (
        mark is not None
        and m is not None
        and downstream(mark, iteration, stage)
        and written_by(m) in (None, stage)
        and m.get("redo") != mark["token"]
    )


def label(mark: dict[str, Any]) -> str:
    it, stage = mark["from"]
    return f"{it}:{stage}"


def folder_stage(folder: str) -> str:
    return layout.STAGE_OF.get(folder, folder)
