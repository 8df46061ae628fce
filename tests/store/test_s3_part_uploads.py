"""A stage's parts on an object store: uploaded in the background while the next is computed,
each created only if absent (a late upload of a command that lost the run lock never replaces
a part), and a part of another stage run found at the commit removed, never committed."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pytest

from rlhf_batch.errors import StageError
from rlhf_batch.store import fs, layout, manifests, output
from rlhf_batch.store.atomic import write_parquet_atomic
from rlhf_batch.store.fs import run_path
from rlhf_batch.store.lock import LockLost

SCHEMA = pa.schema([("x", pa.int64())])


def rows(n: int) -> pa.Table:
    return pa.table({"x": list(range(n))})


def folder(s3_run: str) -> Path:
    return layout.folder(run_path(s3_run), 0, "rollouts")


def claim(sdir: Path) -> output.StageOutput:
    return output.claim(sdir, "rollouts", {"k": 1}, {})


def landed(sdir: Path, n: int, size: int, identity: str) -> None:
    """Part `n` uploaded by another command (the late upload of one that lost the run lock)."""
    write_parquet_atomic(sdir / layout.part_name(0, n), rows(size), SCHEMA, identity=identity)


@pytest.fixture
def fence(monkeypatch: pytest.MonkeyPatch):
    """Set `fs.fence` (the run lock's check before every write) for one test."""

    def set_fence(check) -> None:  # noqa: ANN001
        monkeypatch.setattr(fs, "fence", check)

    return set_fence


def test_two_parts_upload_at_once(s3_run: str, fence) -> None:
    sdir = folder(s3_run)
    out = claim(sdir)
    both = threading.Barrier(2, timeout=20)  # passes only when two part uploads wait at once

    def check(path: Path, commit: bool = False) -> None:
        if path.name.startswith("part-"):
            both.wait()

    fence(check)
    out.write_table(0, rows(3), SCHEMA)
    out.write_table(1, rows(5), SCHEMA)  # returns while part 0 is still waiting to go
    m = out.finish(2)
    assert m is not None and [p["rows"] for p in m["parts"]] == [3, 5]
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(0, 0), layout.part_name(0, 1)]


def test_with_uploads_0_a_part_is_on_the_store_when_written(s3_run: str, monkeypatch) -> None:
    monkeypatch.setenv("RLHF_BATCH_UPLOADS", "0")
    sdir = folder(s3_run)
    out = claim(sdir)
    out.write_table(0, rows(3), SCHEMA)
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(0, 0)]
    assert out.finish(1)["rows"] == 3


def test_a_late_upload_never_replaces_an_object(s3_run: str, tmp_path: Path) -> None:
    path = folder(s3_run) / layout.part_name(0, 0)
    (tmp_path / "a").write_bytes(b"first")
    (tmp_path / "b").write_bytes(b"late")
    assert fs.put_new(tmp_path / "a", path)
    assert not fs.put_new(tmp_path / "b", path)
    assert fs.get_bytes(path) == b"first"


def test_a_part_of_another_stage_run_is_replaced_one_of_this_run_kept(s3_run: str) -> None:
    sdir = folder(s3_run)
    out = claim(sdir)
    landed(sdir, 1, 9, "another config's")
    landed(sdir, 2, 7, out.located)  # an earlier holder of this stage run
    kept = fs.store_of(sdir).version(sdir / layout.part_name(0, 2))
    for n, size in enumerate([3, 5, 7]):
        out.write_table(n, rows(size), SCHEMA)
    m = out.finish(3)
    # 3 + 5 + 7 = 15 rows: part 1 is this run's 5 rows, not the other config's 9
    assert m["rows"] == 15 and [p["rows"] for p in m["parts"]] == [3, 5, 7]
    assert manifests.footer_identity(sdir / layout.part_name(0, 1)) == (5, {}, out.located)
    assert fs.store_of(sdir).version(sdir / layout.part_name(0, 2)) == kept  # not uploaded again


def test_a_part_of_another_stage_run_found_at_the_commit_is_removed(s3_run: str) -> None:
    sdir = folder(s3_run)
    out = claim(sdir)
    out.write_table(0, rows(3), SCHEMA)
    out.write_table(1, rows(5), SCHEMA)
    landed(sdir, 2, 9, "another config's")  # after this run listed the parts it had to write
    with pytest.raises(StageError, match="a part of another config or inputs was here") as e:
        out.finish(3)
    assert "run again to redo it" in str(e.value) and "\n" not in str(e.value)
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(0, 0), layout.part_name(0, 1)]
    assert manifests.manifest(sdir) is None
    again = claim(sdir)
    assert again.todo(3) == [2]
    again.write_table(2, rows(7), SCHEMA)
    assert again.finish(3)["rows"] == 15  # 3 + 5 + 7


def test_a_failed_upload_stops_the_stage_before_its_commit(s3_run: str, fence) -> None:
    sdir = folder(s3_run)
    out = claim(sdir)

    def check(path: Path, commit: bool = False) -> None:
        if path.name == layout.part_name(0, 1):
            raise LockLost(run_path(s3_run) / layout.LOCK, "pid 1 on elsewhere")

    fence(check)
    out.write_table(0, rows(3), SCHEMA)
    out.write_table(1, rows(5), SCHEMA)
    with pytest.raises(LockLost):
        out.finish(2)
    assert [p.name for p in layout.list_parts(sdir)] == [layout.part_name(0, 0)]
    assert manifests.manifest(sdir) is None
