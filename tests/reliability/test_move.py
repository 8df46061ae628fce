"""A run directory with every policy feature on (keep_policies, LoRA) can be moved or copied: no
file of it holds its absolute path (policy_removed.json and the rollouts' `policy` column store
paths relative to the run directory), and `run` in the new place finds every stage complete."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_batch.store import layout
from tests.reliability.harness import environment, snapshot


def rb(*args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rlhf_batch", *map(str, args)]
    return subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=600)


def moved_config(path: Path, old: Path, new: Path) -> Path:
    out = path.with_name(f"{new.name}.toml")
    out.write_text(path.read_text().replace(str(old), str(new)))
    return out


def stage_files(run_dir: Path) -> dict[str, str]:
    """Every stage output (parts, manifests, policies), not the report `run` rewrites."""
    return {k: v for k, v in snapshot(run_dir).items() if k.startswith("iter=")}


@pytest.mark.slow
def test_a_keep_policies_lora_run_moved_and_copied_is_complete_where_it_lands(
    make_config, tmp_path: Path
) -> None:
    path, cfg = make_config(
        "[lora]\nenabled = true\nr = 4\nalpha = 8\n",
        iterations=3,
        in_process=True,
        threads=1,
        keep_policies=1,
    )
    run = Path(cfg.run_dir)
    assert rb("run", path, "--quiet").returncode == 0
    assert (layout.iter_dir(run, 0) / layout.POLICY_REMOVED).is_file()
    files = stage_files(run)
    for f in run.rglob("*"):  # no file holds the run directory's path
        if f.is_file() and f.suffix in (".json", ".parquet") and "report" not in f.parts:
            assert str(run).encode() not in f.read_bytes() or f.name == layout.MANIFEST, f
    policies = pq.read_table(layout.folder(run, 1, "rollouts") / layout.part_name(0, 0))["policy"].to_pylist()
    assert set(policies) == {"iter=0000/policy"}

    moved = tmp_path / "moved"
    shutil.move(run, moved)
    res = rb("run", moved_config(path, run, moved), "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    assert stage_files(moved) == files  # nothing redone
    copy = tmp_path / "copy"
    shutil.copytree(moved, copy)
    res = rb("run", moved_config(path, run, copy), "--quiet", "--iterations", "4")  # and it goes on
    assert res.returncode == 0, res.stderr[-2000:]
    # its complete stages kept (policies aside: keep_policies removes iteration 2's once 3 is trained)
    kept = {k: v for k, v in files.items() if "/policy/" not in k}
    assert {k: v for k, v in stage_files(copy).items() if k in kept} == kept
    assert (layout.folder(copy, 3, "train") / layout.MANIFEST).is_file()
    assert stage_files(moved) == files  # the copy wrote nothing into the original
