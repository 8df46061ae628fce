"""A stage process started by `run` takes its helpers down with it, however it ends.

`run` starts each stage process in a process group of its own, with a parent-death signal
(SIGKILL when `run` dies: pipeline._die_with). Helpers the stage starts (vLLM's EngineCore, a
reward function's workers) are in that group but not its children's parent-death setting. So the
stage process starts a watchdog in its group: a tiny process whose own parent-death signal fires
when the stage process ends (killed or not), and which then kills the whole group. A `run` killed
by SIGKILL during a vLLM generate leaves no EngineCore behind holding the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

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
