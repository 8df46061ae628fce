"""The manifest's rows and counts: from what this process wrote (no footer read back), and from
the footers of the parts other processes wrote (read concurrently on an object store)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rlhf_batch.store import fs, layout, manifests, output
from rlhf_batch.store.fs import run_path

SCHEMA = pa.schema([("x", pa.int64())])


def write_parts(sdir: Path, sizes: list[int]) -> output.StageOutput:
    out = output.claim(sdir, "rollouts", {"k": 1}, {})
    for n, rows in enumerate(sizes):
        out.write_table(n, pa.table({"x": list(range(rows))}), SCHEMA, {"rows_in": rows, "odd": n % 2})
    out.flush()  # on a store the parts upload in the background
    return out


@pytest.mark.parametrize("where", ["local", "s3"])
def test_rows_and_counts_of_known_and_read_parts(where: str, tmp_path: Path, request) -> None:
    root = run_path(request.getfixturevalue("s3_run")) if where == "s3" else tmp_path / "run"
    sdir = layout.folder(root, 0, "rollouts")
    sizes = [3, 5, 7, 2, 4]
    wrote = write_parts(sdir, sizes)
    expected_parts = [{"file": layout.part_name(0, n), "rows": r} for n, r in enumerate(sizes)]
    # another process (rank 0 of others' parts, the last of a fan-out) knows none of them: footers
    other = output.StageOutput(sdir, "rollouts", {"k": 1}, {})
    m = manifests.write_manifest(sdir, "rollouts", len(sizes), other.key, other.identity, None)
    # 3 + 5 + 7 + 2 + 4 = 21 rows; odd parts 1 and 3: 2
    assert m["parts"] == expected_parts and m["rows"] == 21 and m["counts"] == {"rows_in": 21, "odd": 2}
    (sdir / layout.MANIFEST).unlink()
    assert wrote.finish(len(sizes)) == {
        **m,
        "created": wrote.done()["created"],
        "timing": wrote.done()["timing"],
    }


def test_the_writer_reads_no_footer_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sdir = layout.folder(tmp_path / "run", 0, "rollouts")
    out = write_parts(sdir, [3, 5, 7])
    opened: list[Path] = []
    real = manifests.parquet_file
    monkeypatch.setattr(manifests, "parquet_file", lambda p: opened.append(p) or real(p))
    m = out.finish(3)
    assert m is not None and m["rows"] == 15 and m["counts"] == {"rows_in": 15, "odd": 1}
    assert opened == []  # each footer a round trip on an object store: none for the parts written here
    # a part another process wrote (here: removed from what this one knows) is read from its footer
    (sdir / layout.MANIFEST).unlink()
    del out.written[layout.part_name(0, 1)]
    assert out.finish(3)["parts"] == m["parts"] and opened == [sdir / layout.part_name(0, 1)]


def test_a_manifest_counts_its_own_stages_store_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`store_retries` is what this stage retried, not what the process retried before it (a
    `run` executes every stage in one process)."""
    monkeypatch.setattr(fs, "retried", 4)  # an earlier stage of this process retried 4 times
    first = write_parts(layout.folder(tmp_path / "run", 0, "rollouts"), [3])
    assert "store_retries" not in first.finish(1)
    out = write_parts(layout.folder(tmp_path / "run", 1, "rollouts"), [3])
    failures = iter([ConnectionError("reset"), ConnectionError("reset")])

    def flaky() -> str:
        if (e := next(failures, None)) is not None:
            raise e
        return "ok"

    assert fs.retry("s3://b/x", flaky) == "ok"  # two transient errors retried in this stage
    assert out.finish(1)["store_retries"] == 2
