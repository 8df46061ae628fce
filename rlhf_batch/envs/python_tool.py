"""Run a piece of Python code in a child process with limits: the code tool of tool-using rollouts.

What it does: the code runs as `python -I -c CODE` (isolated mode: no user site-packages, no
PYTHON* variables) in a fresh temporary directory (its working directory and $HOME, removed
after the call) with a minimal environment, in a new session (its own process group), and
  * CPU time: RLIMIT_CPU (SIGXCPU at the limit, SIGKILL one second later);
  * memory: RLIMIT_AS (address space; an allocation past it fails: MemoryError in Python);
  * output: stdout and stderr go to one file capped by RLIMIT_FSIZE (SIGXFSZ past the cap; so is
    any file it writes), of which at most `max_output` bytes are returned;
  * wall time: past `timeout_s` the whole process group is killed (SIGKILL), and it is killed in
    any case when the call returns, so children that outlive the code do not outlive the call;
  * network: where the OS allows it, the code runs in a new network namespace (`unshare --user
    --map-root-user --net`, which has only a loopback interface, down): no connection leaves
    it, not even to this machine. Where `unshare` is missing or refused (no user namespaces,
    some containers), the code runs with the host's network, and the result says so
    (`network_isolated` False).

What it does NOT protect against: it is not a security sandbox. The code runs as the same
user, sees the same file system (it can read and write every file that user can, outside its
directory too), the same processes (it can signal them), and the same kernel; a process that
leaves the session (setsid, daemonising) escapes the group kill; the number of processes and
of files written is not limited (RLIMIT_NPROC counts per user and does not bind root), nor is
disk space beyond each file's cap; and without a network namespace it has the network. Run
untrusted code (a policy being trained writes what it likes) inside a container or VM that
bounds all of that, as verl's sandbox-fusion or a gVisor/Firecracker service does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

UNSHARE = ("unshare", "--user", "--map-root-user", "--net", "--")


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    output_bytes: int = 1 << 20  # cap of the output file and of any file written (RLIMIT_FSIZE)
    max_output: int = 4000  # characters of output returned
    timeout_s: float = 10.0  # wall clock; then the process group is killed
    isolate_network: bool = True  # a network namespace where available


@dataclass(frozen=True)
class Result:
    output: str  # stdout and stderr, interleaved, cut to max_output characters
    returncode: int  # negative: killed by that signal
    reason: str  # "ok", "error" (non-zero exit), "timeout", "cpu_limit", "output_limit", "killed"
    truncated: bool
    network_isolated: bool

    def text(self) -> str:
        """The result as the model reads it."""
        note = {
            "ok": "",
            "error": f"[exit code {self.returncode}]",
            "timeout": "[killed: wall-clock time limit]",
            "cpu_limit": "[killed: CPU time limit]",
            "output_limit": "[killed: output size limit]",
            "killed": f"[killed by signal {-self.returncode}]",
        }[self.reason]
        out = self.output + ("\n[output truncated]" if self.truncated else "")
        return "\n".join(s for s in (out, note) if s)


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare --user --map-root-user --net` runs here (once per process)."""
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run `code` under `limits` (module docstring); never raises for what the code does."""
    isolated = limits.isolate_network and network_namespace_available()
    with tempfile.TemporaryDirectory(prefix="rlhf-batch-tool-", ignore_cleanup_errors=True) as tmp:
        out_path = Path(tmp) / ".output"
        work = Path(tmp) / "work"
        work.mkdir()
        argv = [*_limiter(limits), *(UNSHARE if isolated else ()), sys.executable, "-I", "-c", code]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "LANG": "C.UTF-8"}
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            timed_out = _wait(proc, limits.timeout_s)
        _kill_group(proc.pid)
        raw = out_path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    truncated = len(text) > limits.max_output
    code_ = proc.returncode
    reason = _reason(code_, timed_out, len(raw) >= limits.output_bytes)
    return Result(text[: limits.max_output], code_, reason, truncated, isolated)


# Sets the limits, then execs the rest of its arguments: the limits apply before the code starts,
# without a preexec_fn (not safe in a process with threads, as a process pool's parent has).
LIMITER = (
    "import os, resource, sys\n"
    "cpu, mem, size = map(int, sys.argv[1:4])\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "os.execvp(sys.argv[4], sys.argv[4:])\n"
)


def _limiter(limits: Limits) -> list[str]:
    mem = limits.memory_mb << 20
    return [sys.executable, "-I", "-S", "-c", LIMITER, str(limits.cpu_s), str(mem), str(limits.output_bytes)]


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the process; past the time limit kill its group. True if it timed out."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
        return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pgid, signal.SIGKILL)


def _reason(code: int, timed_out: bool, output_full: bool) -> str:
    if timed_out:
        return "timeout"
    if code == -signal.SIGXCPU:
        return "cpu_limit"
    if code == -signal.SIGXFSZ or (output_full and code != 0):
        return "output_limit"
    if code < 0:
        return "killed"
    return "ok" if code == 0 else "error"
