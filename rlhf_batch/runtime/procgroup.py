"""A stage process started by `run` takes its helpers down with it, however it ends.

`run` starts each stage process in a process group of its own, with a parent-death signal
(SIGKILL when `run` dies: die_with). Helpers the stage starts (vLLM's EngineCore, a
reward function's workers) are in that group but not its children's parent-death setting. So the
stage process starts a watchdog in its group: a tiny process whose own parent-death signal fires
when the stage process ends (killed or not), and which then kills the whole group. A `run` killed
by SIGKILL during a vLLM generate leaves no EngineCore behind holding the GPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

GROUP_ENV = "RLHF_BATCH_STAGE_GROUP"  # "self": set by `run` for a stage process that leads a group

# SIGTERM (the parent-death signal, or a kill of the stage) -> SIGKILL to the whole group
_WATCHDOG = """
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *_: os.killpg(os.getpgid(0), signal.SIGKILL))
sys.stdout.write("ready\\n"); sys.stdout.flush()
if os.getppid() != int(sys.argv[1]):
    os.killpg(os.getpgid(0), signal.SIGKILL)
while True:
    signal.pause()
"""


def watch_group() -> subprocess.Popen | None:
    """In a stage process that `run` started in a group of its own: start the watchdog (Linux)."""
    if os.environ.pop(GROUP_ENV, None) != "self" or os.getpgid(0) != os.getpid():
        return None
    return start_watchdog()


def start_watchdog() -> subprocess.Popen:
    """A watchdog in this process's group that kills the group when this process ends (Linux)."""
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def child() -> None:
        prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG, on this (the stage's main) thread's death

    cmd = [sys.executable, "-S", "-I", "-c", _WATCHDOG, str(os.getpid())]
    proc = subprocess.Popen(cmd, preexec_fn=child, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # its handler is in place
    return proc


def die_with(parent: int) -> Callable[[], None] | None:
    """A preexec_fn: the stage process gets SIGKILL when `run` dies (Linux PR_SET_PDEATHSIG), so a
    killed run never leaves a stage writing on after the run lock is released."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls

    def child() -> None:
        os.setpgid(0, 0)  # a group of its own: its helpers die with it (procgroup.py)
        prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # `run` died before the prctl took effect
            os._exit(1)

    return child
