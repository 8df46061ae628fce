"""Every stage, in pipeline order: `rlhf-batch STAGE`, `run` and the Airflow DAG find them here.

A new stage is one module (a `stages.base.Stage` subclass) and one line here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf_batch.errors import UserError

if TYPE_CHECKING:
    from rlhf_batch.stages.base import Stage


def stages() -> tuple[type[Stage], ...]:
    """The stage classes (imported here, not at start-up: `rlhf-batch --help` stays instant)."""
    from rlhf_batch.stages import advantage, audit, evaluate, generate, importer
    from rlhf_batch.stages.score.stage import Score
    from rlhf_batch.stages.train.stage import Train

    return (evaluate.Eval, generate.Generate, importer.Import, Score, advantage.Advantage, Train, audit.Audit)


def pipeline() -> list[type[Stage]]:
    """The stages `run` runs for each iteration, in order."""
    return [s for s in stages() if s.in_pipeline]


def get(name: str) -> type[Stage]:
    for s in stages():
        if s.name == name:
            return s
    raise UserError(f"no stage named {name!r}; stages: {', '.join(s.name for s in stages())}")


def run_stage(
    name: str, cfg: Any, iteration: int, *args: Any, force: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Run stage `name` of iteration `iteration` to completion (or see it is complete) and return
    its manifest: what `rlhf-batch STAGE` does, for tests, benchmarks and other Python callers.
    Extra positional arguments go to the stage (the import file of `import`)."""
    from rlhf_batch.stages.executor import execute

    return execute(get(name)(cfg, iteration, *args), force=force, quiet=quiet)
