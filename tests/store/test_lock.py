import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_batch.errors import StageError
from rlhf_batch.store.layout import LOCK
from rlhf_batch.store.lock import RunLock

HOLD = """
import sys, time
from pathlib import Path
from rlhf_batch.store.lock import RunLock
with RunLock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_second_run_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(StageError, match=rf"holds the lock \(pid {holder.pid} on "), RunLock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    # the holder died without cleaning up: its lock file (with its pid) is still there
    assert f"pid {holder.pid}" in (tmp_path / LOCK).read_text()
    t0 = time.perf_counter()
    with RunLock(tmp_path):
        assert (tmp_path / LOCK).read_text().startswith(f"pid {__import__('os').getpid()} ")
    assert time.perf_counter() - t0 < 5


def test_a_stage_command_is_refused_while_another_command_holds_the_run(make_config) -> None:
    """`generate --force` under a running `run` (or a second `train`) would delete or write files
    under it: a stage command takes the run lock too, and is refused with the holder's pid."""
    path, cfg = make_config()
    run_dir = Path(cfg.run_dir)
    under_holder(run_dir, [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--force", "--quiet"])
    # the lock free again: the same command runs (and `run` below lets its own stage processes in)
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--quiet"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def test_import_is_refused_while_another_command_holds_the_run(make_config, tmp_path: Path) -> None:
    """`import --force` under a running `run` replaced its generated rollouts: import takes the
    run lock like every command that writes a run."""
    path, cfg = make_config()
    run_dir = Path(cfg.run_dir)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a*2=", "response": "aa"}\n')
    cmd = [
        sys.executable,
        "-m",
        "rlhf_batch",
        "import",
        str(rows),
        "--config",
        str(path),
        "--force",
        "--quiet",
    ]
    under_holder(run_dir, cmd)
    res = subprocess.run(cmd, capture_output=True, text=True)  # the lock free again: it imports
    assert res.returncode == 0, res.stderr
    assert (run_dir / "iter=0000" / "rollouts" / "_manifest.json").is_file()


def under_holder(run_dir: Path, cmd: list[str]) -> None:
    """`cmd` while another process holds the run lock: refused naming the holder, nothing written."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        res = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 1
    assert f"holds the lock (pid {holder.pid} on " in res.stderr
    assert not (run_dir / "iter=0000").exists()  # nothing written under the holder
