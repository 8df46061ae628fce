import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_batch.errors import StageError
from rlhf_batch.pipeline import LOCK, RunLock

HOLD = """
import sys, time
from pathlib import Path
from rlhf_batch.pipeline import RunLock
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
