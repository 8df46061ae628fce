import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_batch.errors import SchemaError, StageError
from rlhf_batch.store import atomic, layout, manifests, output

SCHEMA = pa.schema([("rollout_id", pa.string()), ("x", pa.list_(pa.float32()))])


def table(n: int, start: int = 0) -> pa.Table:
    ids = [f"r{i}" for i in range(start, start + n)]
    return pa.table(
        {"rollout_id": ids, "x": pa.array([[float(i)] for i in range(n)], pa.list_(pa.float32()))}
    )


def test_layout_names() -> None:
    assert layout.folder("/r", 3, "scores") == Path("/r/iter=0003/scores")
    assert layout.part_name(1, 42) == "part-00001-00042.parquet"
    assert layout.policy_dir("/r", 0) == Path("/r/iter=0000/policy")


def test_stage_run_writes_parts_then_manifest_and_skips_when_complete(tmp_path: Path) -> None:
    sdir = tmp_path / "iter=0000" / "rollouts"
    st = output.claim(sdir, "rollouts", {"a": 1}, {"in": "x"}, resolved={"a": 1, "run_dir": "/r"})
    assert not st.complete and st.todo(3) == [0, 1, 2]
    for n in range(3):
        st.write_table(n, table(2, 2 * n), SCHEMA, {"rows": 2})
    assert not (sdir / layout.MANIFEST).exists()  # written last, by finish()
    m = st.finish(3)
    assert m is not None and m["rows"] == 6 and m["counts"] == {"rows": 6}
    assert [p["file"] for p in m["parts"]] == [layout.part_name(0, n) for n in range(3)]
    assert m["config"] == {"a": 1} and "versions" in m
    assert m["resolved_config"] == {"a": 1, "run_dir": "/r"}  # recorded, not compared:
    again = output.claim(sdir, "rollouts", {"a": 1}, {"in": "x"}, resolved={"a": 1, "run_dir": "/s"})
    assert again.complete
    assert manifests.read_complete(sdir, SCHEMA).column("rollout_id").to_pylist() == [
        f"r{i}" for i in range(6)
    ]


def test_complete_stage_with_other_config_is_refused_unless_forced(tmp_path: Path) -> None:
    sdir = tmp_path / "s"
    st = output.claim(sdir, "scores", {"a": 1}, {})
    st.write_table(0, table(1), SCHEMA)
    st.finish(1)
    with pytest.raises(StageError, match="different config") as refused:
        output.claim(sdir, "scores", {"a": 2}, {})
    assert "(config.a: 1 on disk, 2 now)" in str(refused.value)  # names what changed
    forced = output.claim(sdir, "scores", {"a": 2}, {}, force=True)
    assert not forced.complete and forced.todo(1) == [0]


def test_partial_stage_resumes_only_missing_parts_and_refuses_a_changed_config(tmp_path: Path) -> None:
    sdir = tmp_path / "s"
    st = output.claim(sdir, "rollouts", {"a": 1}, {})
    st.write_table(1, table(1), SCHEMA)
    (sdir / ".part-00000-00000.parquet.123.tmp").write_bytes(b"half a file")  # a killed writer's leftover
    resumed = output.claim(sdir, "rollouts", {"a": 1}, {})
    assert resumed.todo(3) == [0, 2]
    with pytest.raises(
        StageError, match=r"partial run with a different config .*\(config.a: 1 on disk, 9 now\)"
    ):
        output.claim(sdir, "rollouts", {"a": 9}, {})
    with pytest.raises(StageError, match=r"parts \[0, 2\] are missing"):
        resumed.finish(3)


def test_differences_name_the_changed_keys_first_three_only() -> None:
    old = {"config": {"s": {"lr": 0.1, "kl": 1}, "path": "m"}, "inputs": {"iter=0000/scores": "ab12"}}
    new = {
        "config": {"s": {"lr": 0.2, "kl": 1}, "path": "x" * 50, "extra": True},
        "inputs": {"iter=0000/scores": "cd34"},
    }
    # sorted keys: config.extra (new), config.path (long value), config.s.lr, inputs... (4th: cut off)
    assert manifests.differences(old, new) == (
        "config.extra: missing on disk, true now; config.path changed; "
        "config.s.lr: 0.1 on disk, 0.2 now and 1 more"
    )
    assert manifests.differences(old, {**old, "inputs": {"iter=0000/scores": "cd34"}}) == (
        "inputs.iter=0000/scores changed"  # content hashes are not shown
    )


def test_temporary_files_are_never_read(tmp_path: Path) -> None:
    sdir = tmp_path / "s"
    sdir.mkdir()
    (sdir / ".part-00000-00000.parquet.1.tmp").write_bytes(b"x")
    assert layout.list_parts(sdir) == []


def test_failed_write_leaves_no_part(tmp_path: Path) -> None:
    bad = pa.table({"rollout_id": ["a"], "x": [["not a float"]]})  # the cast to the schema fails
    with pytest.raises(pa.ArrowInvalid):
        atomic.write_parquet_atomic(tmp_path / "part-00000-00000.parquet", bad, SCHEMA)
    assert list(tmp_path.iterdir()) == []


def test_schema_checked_reads_name_file_and_column(tmp_path: Path) -> None:
    p = tmp_path / "part-00000-00000.parquet"
    pq.write_table(pa.table({"rollout_id": ["a"], "x": [[1.0]]}), p)  # x is list<double>, not float32
    with pytest.raises(
        SchemaError, match=r"part-00000-00000.parquet: column 'x' has type list<element: double>"
    ):
        manifests.read_part(p, SCHEMA)
    pq.write_table(pa.table({"x": pa.array([[1.0]], pa.list_(pa.float32()))}), p)
    with pytest.raises(SchemaError, match="missing column 'rollout_id'"):
        manifests.read_part(p, SCHEMA)
    p.write_bytes(b"PAR1 truncated")
    with pytest.raises(SchemaError, match="not a readable Parquet file"):
        manifests.read_part(p, SCHEMA)


def test_parts_carry_the_schema_version_and_readers_check_it(tmp_path: Path) -> None:
    p = tmp_path / "part-00000-00000.parquet"
    atomic.write_parquet_atomic(p, table(2), SCHEMA)
    assert pq.read_schema(p).metadata[b"rlhf_batch.schema_version"] == b"1"
    assert manifests.read_part(p, SCHEMA).num_rows == 2
    future = table(2).replace_schema_metadata({b"rlhf_batch.schema_version": b"2"})
    pq.write_table(future, p)
    with pytest.raises(SchemaError, match=r"part-00000-00000.parquet: written with table schema version 2; "):
        manifests.read_part(p, SCHEMA)
    pq.write_table(table(2), p)  # no version key: a file from another tool, read by its columns
    assert manifests.read_part(p, SCHEMA).num_rows == 2


def test_extra_columns_are_allowed(tmp_path: Path) -> None:
    p = tmp_path / "part-00000-00000.parquet"
    t = table(2).append_column("answer", pa.array(["1", "2"]))
    pq.write_table(t, p)
    assert manifests.read_part(p, SCHEMA).column_names == ["rollout_id", "x", "answer"]


def test_json_is_atomic_and_readable(tmp_path: Path) -> None:
    atomic.write_json_atomic(tmp_path / "m.json", {"b": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"b": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_file_fingerprint_changes_with_content(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text("a")
    before = manifests.file_fingerprint(f)
    f.write_text("b")
    after = manifests.file_fingerprint(f)
    assert after != before
    os.utime(f, (0, 0))  # touching the file does not change it
    assert manifests.file_fingerprint(f) == after


def test_a_full_disk_under_torch_save_is_named_as_such(tmp_path: Path) -> None:
    """torch.save on a full disk raises RuntimeError("[enforce fail at inline_container.cc...]"),
    not an OSError: the message still says what happened. A real full filesystem: a 256 KB tmpfs."""
    import subprocess

    import torch

    from rlhf_batch.store.atomic import write_error

    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        target = mnt / "optimizer.pt"
        with pytest.raises(RuntimeError) as info:
            torch.save({"m": torch.zeros(1 << 18)}, target)  # 1 MB into 256 KB
        assert str(write_error(target, info.value)) == (
            f"{target}: cannot write (No space left on device); free disk space and run again, "
            "finished work is kept"
        )
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)  # lazy: torch may still hold the file


def test_fsync_false_skips_the_fsyncs_but_keeps_writes_atomic(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    sdir = tmp_path / "s"
    try:
        # durable (the default): claim writes _started.json (file + directory), the part and the
        # manifest likewise: 2 fsyncs each, 6 in all
        st = output.claim(sdir, "scores", {"a": 1}, {})
        st.write_table(0, table(2), SCHEMA)
        st.finish(1)
        assert len(synced) == 6
        synced.clear()
        atomic.set_durable(False)  # what execute() does for a config with fsync = false
        other = output.claim(tmp_path / "t", "scores", {"a": 1}, {})
        other.write_table(0, table(2), SCHEMA)
        m = other.finish(1)
        assert synced == []
        assert (
            m is not None and m["rows"] == 2 and not list((tmp_path / "t").glob(".*"))
        )  # renamed, no temp left
    finally:
        atomic.set_durable(True)


def test_the_questions_read_only_what_prepare_set(make_config) -> None:
    """identity(), inputs() and check() load nothing: asked before prepare() they fail on the
    attribute prepare sets; asked after it, twice, they return what it loaded."""
    from rlhf_batch.stages.generate import Generate

    _, cfg = make_config()
    stage = Generate(cfg, 0)
    for question in (stage.inputs, stage.check):
        with pytest.raises(AttributeError):
            question()
    stage.prepare()
    first = stage.inputs()
    assert first["iteration"] == 0 and first["policy"]["path"] == cfg.policy_model
    assert stage.inputs() is first  # read, not loaded again
    stage.check()  # the policy prepare found is there
