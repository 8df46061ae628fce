"""Fault points for the reliability tests: a named place where a test can kill the process."""

from __future__ import annotations

import os
import signal

FAULT_ENV = "RLHF_BATCH_FAULT"


def fault_point(name: str) -> None:
    """SIGKILL this process when $RLHF_BATCH_FAULT names this point (e.g. 'rollouts:part-2:tmp',
    'scores:part-0:done', 'train:manifest'); SIGSTOP it (a paused machine, until SIGCONT) when
    it names 'stop:' and this point."""
    fault = os.environ.get(FAULT_ENV)
    if fault == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == f"stop:{name}":
        os.kill(os.getpid(), signal.SIGSTOP)
