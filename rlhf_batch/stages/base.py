"""The stage interface: what a stage declares, and what the executor does with it.

A stage (a command: generate, import, score, advantage, train, eval) reads folders of earlier stages
and writes one output folder of one iteration, cut into numbered parts whose content depends
only on the part number. It declares:

* `name` (the command), `folder` (its output folder, layout.FOLDERS);
* `runs_at(cfg, iteration)`: whether `run` runs it at that iteration (default: 0..iterations-1);
* `prepare()`: load what the questions below need (the policy it starts from, fingerprints of
  what it reads into `self.fingerprints`); raises StageError when an input is not complete. The
  executor calls it once, before it asks any question (`execute` and `is_done` alike);
* `identity()`: the config that decides its result (config.Config.identity plus derived values);
* `inputs()`: fingerprints of what it reads (`self.fingerprints`, set by `prepare`);
* `load()`: read the inputs the parts are made of, only when the stage runs (not for `is_done`);
  bad input fails here, before the folder is marked started;
* `check()`: validation of what `prepare` and `load` set, before the folder is marked started;

`identity()`, `inputs()` and `check()` only read what `prepare` and `load` set: asking them twice
reads nothing twice, and asking them of a stage not prepared fails on the missing attribute.
* `plan()`: the number of parts; `write_part(n, bar)`: the content of part n (the executor
  writes it atomically); `write_parts` for a stage that streams its parts or writes other files;
* `manifest_extra()`: manifest entries beyond the parts and their summed counts;
* `on_complete()`: tidy-up once the folder is complete (also when it already was);
* timing (timing.py): each Part's `tokens`, `self.clock.add(n)` for tokens not written in a
  Part, and `work_begins()` where start-up ends when that is not after `open` (the default).

`rlhf_batch.stages.executor.execute` owns everything they have in common: refusal and --force, resume
of missing parts, rank slicing, progress and the manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rlhf_batch.config import Config
from rlhf_batch.store import layout
from rlhf_batch.store.output import Part

if TYPE_CHECKING:
    import pyarrow as pa

    from rlhf_batch.runtime.timing import StageClock
    from rlhf_batch.store.output import StageOutput


def list_tokens(table: pa.Table, *columns: str) -> int:
    """The total length of the list columns `columns` of `table` (token ids: a part's tokens)."""
    import pyarrow.compute as pc

    return sum(int(pc.sum(pc.list_value_length(table[c])).as_py() or 0) for c in columns)


class Stage:
    name: ClassVar[str]  # the command
    folder: ClassVar[str]  # the output folder below iter=K/
    in_pipeline: ClassVar[bool] = True  # `run` runs it, in registry order
    single_writer: ClassVar[bool] = False  # rank 0 writes every part (others only wait)
    unit: ClassVar[str] = "part"  # of the progress bar
    unit_scale: ClassVar[bool] = False

    def __init__(self, cfg: Config, iteration: int, topup: int = 0):
        self.cfg: Config = cfg
        self.iteration: int = iteration
        self.topup: int = topup  # > 0: a top-up round of the iteration (generate and score only; topup.py)
        self.force: bool = False  # set by the executor: the run was asked to replace what differs
        self.clock: StageClock | None = None  # set by the executor: start-up, work and tokens
        self.staging: Path | None = None  # set by the executor under --force: where the output is written
        self.fingerprints: dict[str, Any]  # set by prepare(): what inputs() returns

    @classmethod
    def runs_at(cls, cfg: Config, iteration: int) -> bool:
        """Whether `run` runs this stage at `iteration` (0..cfg.iterations; the default: every
        iteration before cfg.iterations)."""
        return iteration < cfg.iterations

    @property
    def sdir(self) -> Path:
        """The folder the stage writes: its output folder, or under --force the staging folder
        beside it (staging.py), swapped in once complete."""
        if self.staging is not None:
            return self.staging
        return layout.folder(self.cfg.run_dir, self.iteration, self.folder, self.topup)

    @property
    def progress_desc(self) -> str:
        return self.name

    def prepare(self) -> None:
        """Load what identity(), inputs() and check() read; set `self.fingerprints`."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        return self.cfg.identity(self.name)

    def inputs(self) -> dict[str, Any]:
        return self.fingerprints

    def load(self) -> None:
        """Read the inputs writing the parts needs, once the stage is to run (default: nothing)."""

    def check(self) -> None:
        """Validate what the stage reads before its folder is marked started (default: nothing)."""

    def plan(self) -> int:
        raise NotImplementedError

    def open(self, todo: list[int]) -> None:
        """Load what writing the parts `todo` needs (models); called only when todo is not empty."""

    def progress_total(self, todo: list[int]) -> int | None:
        """The progress bar's total for the parts `todo` (after `open` when todo is not empty)."""
        return len(todo)

    def write_part(self, n: int, bar: Any) -> Part:
        raise NotImplementedError

    def write_parts(self, todo: list[int], out: StageOutput, bar: Any) -> None:
        """This rank's missing parts, one by one; a stage that streams overrides this."""
        for n in todo:
            out.write(n, self.write_part(n, bar))

    def manifest_extra(self) -> dict[str, Any]:
        """Rank 0, after every part is on disk: manifest entries beyond parts and counts."""
        return {}

    def on_complete(self) -> None:
        """Rank 0, once the folder is complete (also when it already was): tidy up."""

    def close(self) -> None:
        """Release what the stage holds (connections, temp files), however it ended."""

    def work_begins(self) -> None:
        """Start-up ends now (the latest call counts): a stage whose work starts before `open`
        returns, or which loads its model while writing, says where."""
        if self.clock is not None:
            self.clock.work_begins()
