"""Every stage, in pipeline order: `rlhf-batch STAGE`, `run` and the Airflow DAG find them here.

A new stage is one module (a `stages.base.Stage` subclass) and one line here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_batch.errors import UserError

if TYPE_CHECKING:
    from rlhf_batch.stages.base import Stage


def stages() -> tuple[type[Stage], ...]:
    """The stage classes (imported here, not at start-up: `rlhf-batch --help` stays instant)."""
    from rlhf_batch.stages import advantage, evaluate, generate, importer, score, train

    return (evaluate.Eval, generate.Generate, importer.Import, score.Score, advantage.Advantage, train.Train)


def pipeline() -> list[type[Stage]]:
    """The stages `run` runs for each iteration, in order."""
    return [s for s in stages() if s.in_pipeline]


def get(name: str) -> type[Stage]:
    for s in stages():
        if s.name == name:
            return s
    raise UserError(f"no stage named {name!r}; stages: {', '.join(s.name for s in stages())}")
