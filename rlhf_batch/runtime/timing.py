"""Where a stage's time goes: start-up (imports, model and tokenizer loads: everything before its
first unit of work) and work, and the tokens it processed, recorded in its manifest as `timing`.

The executor owns the clock (`StageClock`, one per stage run). Start-up counts from the stage
command's process start when the stage runs in a process of its own (the CLI's stage commands,
so interpreter start and imports are included), else from the call of `execute` (`run
--in-process`, the Python API). It ends when the executor has called the stage's `open`, or
later, when a stage that loads its model while writing (train) says so (`work_begins`). Work
ends when the manifest is written. Only rank 0's clock is recorded; tokens are summed over ranks.
"""

from __future__ import annotations

import os
import time
from typing import Any

IMPORTED = time.monotonic()  # the fallback process start: the CLI imports this module at start


def process_start() -> float:
    """This process's start on the `time.monotonic` clock. Linux: the start time the kernel
    records (/proc/self/stat field 22, clock ticks since boot, 10 ms resolution) against
    CLOCK_BOOTTIME, which counts from the same boot; elsewhere, or if /proc cannot be read: when
    this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22; fields[0] is field 3
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, IndexError, ValueError, AttributeError):
        return IMPORTED
    now = time.monotonic()
    return now - age if age >= 0 else IMPORTED


class StageClock:
    """Start-up from `since` (a `time.monotonic` value; default now) to `work_begins`, work from
    there to `record`; `tokens` counted with `add`."""

    def __init__(self, since: float | None = None):
        self.since = time.monotonic() if since is None else since
        self.work_start: float | None = None
        self.tokens = 0

    def work_begins(self) -> None:
        """The end of start-up: the latest call before the work counts."""
        self.work_start = time.monotonic()

    def add(self, tokens: int) -> None:
        self.tokens += int(tokens)

    def record(self, tokens: int | None = None) -> dict[str, Any]:
        """The manifest's `timing` entry, now (`tokens`: the total over ranks, default this rank's)."""
        now = time.monotonic()
        work_start = now if self.work_start is None else self.work_start
        startup, work = work_start - self.since, now - work_start
        tokens = self.tokens if tokens is None else tokens
        return {
            "startup_s": round(startup, 4),
            "work_s": round(work, 4),
            "tokens": tokens,
            "tokens_per_s": round(tokens / work, 1) if work > 0 else None,
        }
