"""The output folder of one stage run, which every stage writes through: its identity (config,
input fingerprints, schema version), refusal of a folder with another identity, the parts not
yet on disk, each part written atomically, and the manifest written last (the commit).
The executor (stages/executor.py) drives it; tests and hand-written folders use `claim`."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_batch.errors import StageError
from rlhf_batch.runtime import dist
from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.runtime.timing import StageClock
from rlhf_batch.store import fs, layout, staging
from rlhf_batch.store.atomic import part_table, write_json_atomic, write_parquet_atomic
from rlhf_batch.store.manifests import (
    StaleParts,
    differences,
    fingerprint,
    footer_identity,
    located_key,
    manifest,
    read_json,
    same_identity,
    write_manifest,
)
from rlhf_batch.store.schemas import SCHEMA_VERSION


@dataclass
class Part:
    """One part's rows, the schema it is written with and the counts summed into the manifest."""

    table: pa.Table
    schema: pa.Schema
    counts: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # the tokens the stage processed for it (the manifest's timing)


class StageOutput:
    """The output folder of one stage run, identified by `config` (what decides the result) and
    `inputs` (fingerprints of what it reads). `record` (the whole resolved config) and `command`
    are written into the manifest for the record; they are not compared."""

    def __init__(
        self,
        sdir: Path,
        folder: str,
        config: dict,
        inputs: dict,
        record: dict | None = None,
        command: str | None = None,
    ):
        self.sdir, self.folder, self.record, self.command = sdir, folder, record, command
        self.rank, self.world = dist.rank_world()
        root = layout.run_root(sdir)
        self.identity = {
            "config": layout.portable(config, root),
            "inputs": layout.portable(inputs, root),
            "schema_version": SCHEMA_VERSION,
        }
        self.key = fingerprint(self.identity)
        # fanned out or on a store: in each part, checked at the commit
        self.located = located_key(self.identity)
        self.remote = not fs.store_of(sdir).local  # parts uploaded in the background (`uploads`)
        self.marked = dist.fanned_out() or self.remote  # parts carry `located`
        self.uploads: fs.Uploads | None = None
        self.complete = False
        self.final = sdir  # where the output ends up (sdir: where it is written)
        self.clock = StageClock()  # execute() gives it the stage's start
        self.written: dict[str, tuple[int, dict]] = {}  # part name -> (rows, counts) written here
        self.retried = fs.retried  # the process's store retries before this stage (see `finish`)

    def done(self) -> dict[str, Any] | None:
        """The manifest when the folder is complete with this identity; None when not complete;
        an error when it is complete with another one."""
        m = manifest(self.sdir)
        if m is not None and not same_identity(m, self.key, self.identity):
            raise StageError(
                f"{self.sdir}: stage is complete with a different config or inputs "
                f"({differences(m, self.identity)}); replace it with {layout.redo_command(self.sdir, self.command or '')}, "
                f"or it and every stage after it with {layout.redo_from_command(self.sdir, self.command or '')}"
            )
        self.complete = m is not None
        return m

    def stage_beside(self) -> Path:
        """Write into the staging folder beside the output (`--force`): the old output stays
        until the new one is complete (`commit`). Staged parts of another identity are removed."""
        if dist.fanned_out():  # each rank redoes its own parts in place (`begin`)
            return self.sdir
        self.final, self.sdir = self.sdir, staging.staged(self.sdir)
        started = self.sdir / layout.STARTED
        if self.rank == 0 and self.sdir.exists():
            before = read_json(started) if started.exists() else None
            if before is None or not same_identity(before, self.key, self.identity):
                fs.remove(self.sdir)
        return self.sdir

    def commit(self) -> None:
        """After the manifest of a staged run: rank 0 swaps the new output in."""
        if self.rank == 0:
            staging.commit(self.final)
        self.sdir = self.final
        dist.barrier()

    def begin(self, force: bool = False) -> None:
        """Claim the folder: refuse the parts of a partial run with another identity (unless
        `force`: then the folder is the staging folder of `stage_beside`); record this identity
        in `_started.json`."""
        if force and dist.fanned_out():
            self._redo_mine()
        dist.barrier()
        if self.done() is not None:
            return
        started = self.sdir / layout.STARTED
        # a run that failed before writing any part leaves nothing to protect: a new config takes over
        before = read_json(started) if started.exists() else None
        if (
            not force
            and before is not None
            and not same_identity(before, self.key, self.identity)
            and layout.list_parts(self.sdir)
        ):
            raise StageError(
                f"{self.sdir}: a partial run with a different config or inputs is here "
                f"({differences(before, self.identity)}); re-run with the same config and inputs, or start it over "
                f"with {layout.redo_command(self.sdir, self.command or '')}"
            )
        if dist.leads():
            fs.makedirs(self.sdir)
            if not dist.fanned_out():  # a fanned-out process would take another's file in progress
                for tmp in layout.leftovers(self.sdir):  # a killed writer's files and folders (parts,
                    fs.remove(tmp)  # manifest, _started, train's optimizer state and policy)
            write_json_atomic(started, {"key": self.key, **self.identity})
        dist.barrier()

    def _redo_mine(self) -> None:
        """`--force` of a fanned-out rank: the manifest goes (the last rank commits again) and
        this rank's parts (n % world == rank, whoever wrote them); the other ranks' parts stay,
        and the commit refuses any that another identity wrote (force their ranks too)."""
        if (self.sdir / layout.MANIFEST).exists():
            fs.remove(self.sdir / layout.MANIFEST)
        for p in layout.list_parts(self.sdir):
            if layout.part_number(p) % self.world == self.rank:
                fs.remove(p)

    def todo(self, n_parts: int, single_writer: bool = False) -> list[int]:
        """This rank's part numbers that are not on disk yet."""
        have = {layout.part_number(p) for p in layout.list_parts(self.sdir)}
        mine = (lambda n: self.rank == 0) if single_writer else (lambda n: n % self.world == self.rank)
        return [n for n in range(n_parts) if mine(n) and n not in have]

    def write(self, n: int, part: Part) -> Path:
        path = self.write_table(n, part.table, part.schema, part.counts)
        self.clock.add(part.tokens)
        return path

    def write_table(self, n: int, table: pa.Table, schema: pa.Schema, counts: dict | None = None) -> Path:
        """Part `n` of this rank, written atomically (on a store: uploaded in the background, done
        by `finish`); `counts` are summed into the manifest."""
        path = self.sdir / layout.part_name(self.rank, n)
        who = self.located if self.marked else ""  # checked by whoever commits
        if self.remote:
            self._upload(path, part_table(table, schema, counts, who), f"{self.folder}:part-{n}")
        else:
            write_parquet_atomic(path, table, schema, counts, fault=f"{self.folder}:part-{n}", identity=who)
        self.written[path.name] = (table.num_rows, dict(counts or {}))
        fault_point(f"{self.folder}:part-{n}:done")
        return path

    def _upload(self, path: Path, table: pa.Table, fault: str) -> None:
        """Write the part locally now, upload it in the background (`_put_part`)."""
        if self.uploads is None:
            self.uploads = fs.Uploads()
        tmp = self.uploads.scratch(path.name)
        try:
            pq.write_table(table, tmp, compression="zstd")
        except OSError as e:
            raise fs.write_error(path, e, tmp) from e
        fault_point(f"{fault}:tmp")
        self.uploads.submit(tmp, lambda: self._put_part(tmp, path))

    def _put_part(self, tmp: Path, path: Path) -> None:
        """Upload a part only if there is none (a late upload of a command that lost the run
        lock then never replaces it); one already there is kept when this stage run wrote it
        (the same rows), else replaced."""
        if fs.put_new(tmp, path) or footer_identity(path)[2] == self.located:
            return
        fs.remove(path)
        if not fs.put_new(tmp, path):
            raise StageError(
                f"{path}: another command writes this part at the same time; stop it, then run again"
            )

    def flush(self) -> None:
        """Every part written so far is on the store (the background uploads are done)."""
        if self.uploads is not None:
            self.uploads.wait()

    def close(self) -> None:
        """The uploads still in flight waited for (a stage that failed)."""
        if self.uploads is not None:
            self.uploads.close()
            self.uploads = None

    def finish(self, n_parts: int, extra: Any = None) -> dict[str, Any] | None:
        """After every rank is done: rank 0 checks the parts and writes the manifest. `extra` is
        a dict of manifest entries, or a function returning one (called on rank 0 only).
        Fanned out (no process group), the process that finds every part there commits: the
        manifest is created only if it does not exist, so of two finishing together one commits
        and the other returns the manifest it wrote; one that finds parts missing returns None."""
        self.flush()
        self.close()
        dist.barrier()
        tokens = dist.all_sum(self.clock.tokens)
        result = None
        if dist.fanned_out():
            have = {layout.part_number(p) for p in layout.list_parts(self.sdir)}
            if any(n not in have for n in range(n_parts)):
                return None  # another process's parts are still to come: the last one commits
        if dist.leads():
            fault_point(f"{self.folder}:manifest")
            record: dict[str, Any] = {"resolved_config": self.record} if self.record is not None else {}
            if self.command is not None:
                record["command"] = self.command
            more = extra() if callable(extra) else extra
            record["timing"] = self.clock.record(tokens)
            if fs.retried > self.retried:  # transient store errors this stage retried (store/fs.py retry)
                record["store_retries"] = fs.retried - self.retried
            try:
                result = write_manifest(
                    self.sdir,
                    self.folder,
                    n_parts,
                    self.key,
                    self.identity,
                    {**record, **(more or {})},
                    exclusive=dist.fanned_out(),
                    known=self.written,
                    located=self.located if self.marked else None,
                )
            except StaleParts as e:  # fanned out: this rank's parts are done; another's are old
                if not dist.fanned_out():  # a late upload of a command that lost the run lock
                    fs.remove(e.path)
                    raise StageError(
                        f"{e.path}: a part of another config or inputs was here (a late upload of a "
                        "command that lost the run lock); it was removed: run again to redo it"
                    ) from None
                print(f"{e}; this rank's parts are written, the stage is not committed", file=sys.stderr)
                return None
        dist.barrier()
        if self.final != self.sdir:  # staged (--force): the new output is complete, swap it in
            self.commit()
        return result


def claim(
    sdir: Path, folder: str, config: dict, inputs: dict, force: bool = False, resolved: dict | None = None
) -> StageOutput:
    """A StageOutput checked (`done`) and claimed (`begin`): for writing a folder by hand."""
    out = StageOutput(sdir, folder, config, inputs, resolved)
    if force:
        out.stage_beside()
    if force or out.done() is None:
        out.begin(force)
    return out
