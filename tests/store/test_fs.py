"""The storage layer's choices, one by one: which run directories are local, which are URIs, and
the one-line errors for a scheme this machine cannot reach."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.errors import ConfigError
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import fs, layout
from rlhf_batch.store.manifests import manifest


def test_local_paths_stay_pathlib_paths(tmp_path: Path) -> None:
    assert fs.run_path(str(tmp_path)) == tmp_path and type(fs.run_path(str(tmp_path))) is type(tmp_path)
    assert fs.run_path(f"file://{tmp_path}") == tmp_path
    assert fs.scheme("runs/demo") == "" and fs.scheme("file:///x") == "" and fs.scheme("s3://b/p") == "s3"
    assert fs.store_of(tmp_path) is fs.LOCAL and fs.store_of(fs.run_path("s3://b/p")) is fs.S3


def test_a_scheme_without_its_package_or_unknown_is_a_one_line_error() -> None:
    if fs.importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed in this venv")
    with pytest.raises(
        ConfigError,
        match=r"run_dir gs://b/run: the gs:// store needs the gcsfs package: pip install 'rlhf-batch\[gcs\]'",
    ):
        fs.run_path("gs://b/run")
    with pytest.raises(ConfigError, match=r"run_dir ftp://h/run: unknown scheme 'ftp://'"):
        fs.run_path("ftp://h/run")


def test_a_stage_on_a_store_it_cannot_reach_writes_nothing_locally(make_config, tmp_path: Path) -> None:
    """The bug this guards: `--set run_dir=s3://bucket/run` wrote the whole run into ./s3:/."""
    path, _ = make_config()
    for uri, words in (("gs://bucket/run", "needs the gcsfs package"), ("ftp://h/run", "unknown scheme")):
        if "gcsfs" in words and fs.importlib.util.find_spec("gcsfs") is not None:
            continue
        done = subprocess.run(
            [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--set", f"run_dir={uri}", "--quiet"],
            capture_output=True, text=True, cwd=tmp_path, env=os.environ.copy(),
        )  # fmt: skip
        assert done.returncode == 1 and words in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert not any(p.name.endswith(":") for p in tmp_path.iterdir())  # no gs: or ftp: folder


def test_create_is_exclusive_on_local_disk_and_on_the_store(tmp_path: Path, s3_run: str) -> None:
    for root in (tmp_path, fs.run_path(s3_run)):
        target = root / "x.json"
        assert fs.create(target, b"first") is True
        assert fs.create(target, b"second") is False  # If-None-Match: * on the store
        assert target.read_bytes() == b"first"


def test_read_commands_take_a_run_on_the_store(s3_server, s3_run: str, make_config) -> None:

    path, cfg = make_config(run_dir=s3_run)
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlhf_batch", *args], capture_output=True, text=True)

    before = len(s3_server.requests())
    status = cli("status", s3_run)
    assert status.returncode == 0, status.stderr
    assert f"run: {s3_run}" in status.stdout and "rollouts    complete" in status.stdout
    # What status needs, read through one listing of the run (fs.snapshot): 1 LIST (the run has
    # < 1000 objects), then GETs only, no HEAD: each of the 2 manifests at most 4 times (the view's
    # file list, DuckDB's `stages` view, the stage's state, scores' check of its input), each of
    # the 4 Parquet parts (12 prompts / 5 per part = 3 of rollouts, 1 of scores) at most 12 times
    # (once per DuckDB statement that binds a view over it: the views, prompt_stats, source_stats,
    # turns, status's own query, the reward_health view registered and queried; DuckDB keeps no footer of
    # an fsspec file between statements): 1 + 2 x 4 + 4 x 12 = 57. Before, every look was a HEAD
    # or a LIST of its own (~280 an iteration).
    reqs = s3_server.requests()[before:]
    kinds = [(r["method"], "list-type" in r["query"]) for r in reqs]
    assert kinds.count(("GET", True)) == 1 and {m for m, _ in kinds} == {"GET"}, kinds
    assert len(reqs) <= 57, [(r["method"], r["path"]) for r in reqs]
    sql = cli("sql", "--run-dir", s3_run, "--format", "csv", "SELECT count(*) AS n FROM scores")
    assert sql.returncode == 0 and sql.stdout.split() == ["n", "48"], sql.stderr
    report = cli("report", str(path))
    assert report.returncode == 0, report.stderr
    assert report.stdout.strip() == f"report: {s3_run}/report/report.html"
    assert (fs.run_path(s3_run) / "report" / "reward.png").read_bytes()[:4] == b"\x89PNG"


def test_advantage_reads_its_inputs_through_one_listing(s3_server, s3_run: str, make_config) -> None:
    _, cfg = make_config(run_dir=s3_run)
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)
    before = len(s3_server.requests())
    run_stage("advantage", cfg, 0, quiet=True)
    reqs = s3_server.requests()[before:]
    # its inputs are committed: every look at a part of rollouts or scores (its footer, DuckDB
    # opening it once per statement) is answered by one listing of the run, so a part costs GETs
    # only; before, each look was a HEAD: 28 per rollouts part and 26 per scores part here (3 + 1
    # parts: 110 HEADs), counted on the server before the change
    parts = [
        r for r in reqs if "/part-" in r["path"] and ("/rollouts/" in r["path"] or "/scores/" in r["path"])
    ]
    assert parts and {r["method"] for r in parts} == {"GET"}, [
        (r["method"], r["path"][-40:]) for r in parts if r["method"] != "GET"
    ]
    assert manifest(layout.folder(s3_run, 0, "advantages"))["rows"] > 0


def test_trackers_of_a_run_on_the_store_write_beside_the_model_cache(
    s3_run: str, make_config, tmp_path: Path, monkeypatch
) -> None:

    monkeypatch.setenv("RLHF_BATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    _, cfg = make_config(run_dir=s3_run, report_to=["tensorboard"])
    run_stage("generate", cfg, 0, quiet=True)
    events = list((fs.local_side(s3_run, "tracking") / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].is_relative_to(tmp_path / "cache" / "runs")
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir())  # no local folder named s3:


def test_every_scheme_run_path_opens_has_a_store() -> None:
    assert set(fs.PACKAGES) <= set(fs.STORES)
    assert fs.STORES["s3"].fences and not fs.STORES["gs"].fences and fs.STORES[""].local


def test_a_store_without_fencing_refuses_to_lock_a_run_in_one_line() -> None:
    """gs:// maps to the generic fsspec store (no versioned conditional writes); fsspec's memory
    filesystem takes the same path here, gcsfs not being installed."""
    from upath import UPath

    from rlhf_batch.errors import StageError
    from rlhf_batch.store.lock import RunLock

    run = UPath("memory://bucket/run")
    assert fs.store_of(run) is fs.STORES["gs"]
    with pytest.raises(StageError) as e, RunLock(run):
        pass
    assert str(e.value) == (
        "run_dir memory://bucket/run: a run on memory:// cannot be written: its run lock needs "
        "conditional writes on the lock's version (If-Match), implemented for s3:// only; use s3:// "
        "or a local run_dir"
    )
    assert not (run / ".run.lock").exists()  # nothing written


def test_a_folder_uploaded_from_this_machine_is_read_back_from_its_cache(
    s3_server, s3_run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder written to the store (a policy, as train writes it: write_dir_atomic) arrives whole
    (its 9 files uploaded several at once) and becomes this machine's cached copy: reading it back
    (`local_dir`, as the next iteration's stages do) is one LIST and no download. A folder another
    machine wrote is downloaded once (one GET per object), then read from the cache."""
    import shutil

    from rlhf_batch.store.atomic import write_dir_atomic

    monkeypatch.setenv("RLHF_BATCH_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "policy"
    for i in range(8):
        (src / f"shard-{i}").mkdir(parents=True)
        (src / f"shard-{i}" / "weights.bin").write_bytes(bytes([i]) * (1000 + i))
    (src / "config.json").write_text('{"n": 8}')
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    root = fs.run_path(s3_run)
    write_dir_atomic(root / "policy", lambda tmp: shutil.copytree(src, tmp, dirs_exist_ok=True))
    stored = root / "policy"
    assert {
        p.relative_to(stored).as_posix(): p.read_bytes() for p in stored.rglob("*") if p.is_file()
    } == files

    def reads(path: Path) -> tuple[Path, list[str]]:
        before = len(s3_server.requests())
        local = fs.local_dir(path)
        return local, [
            r["method"] + ("-LIST" if "list-type" in r["query"] else "")
            for r in s3_server.requests()[before:]
        ]

    local, kinds = reads(stored)
    assert kinds == ["GET-LIST"] and local.is_relative_to(tmp_path / "cache")
    assert {
        p.relative_to(local).as_posix(): p.read_bytes()
        for p in local.rglob("*")
        if p.is_file() and p.name != ".complete"
    } == files
    other = root / "other"  # written by another machine: through s3fs, not this cache
    fs.filesystem(other).put(f"{src}/", fs.key(other) + "/", recursive=True)
    local, kinds = reads(other)
    assert sorted(kinds) == ["GET"] * 9 + ["GET-LIST"]
    assert reads(other) == (local, ["GET-LIST"])  # once per machine


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_a_store_deadline_must_be_a_finite_positive_number(value: str, monkeypatch) -> None:
    """inf would let a store that stops answering hold a command for ever."""
    monkeypatch.setenv("RLHF_BATCH_STORE_DEADLINE_S", value)
    with pytest.raises(ConfigError, match=f"^RLHF_BATCH_STORE_DEADLINE_S={value}: must be a finite number"):
        fs.timeout("deadline")
