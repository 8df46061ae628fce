"""Run a piece of Python code in a child process with limits: the code tool of tool-using rollouts.

The code runs as `python -I -c CODE` (isolated mode: no user site-packages, no PYTHON* variables)
with a minimal environment (PATH, HOME, LANG: none of the stage's variables), under a runner
(RUNNER) that sets the limits, starts the code and ends the call:
  * CPU time: RLIMIT_CPU (SIGXCPU at the limit, SIGKILL one second later), per process;
  * memory: RLIMIT_AS (address space; an allocation past it fails: MemoryError), per process;
  * output: stdout and stderr go to one unnamed file capped by RLIMIT_FSIZE (SIGXFSZ past the cap;
    so is any file it writes), of which at most `max_output` bytes are returned;
  * wall time: the runner ends the call past `timeout_s`, and also as soon as the process that
    called it is gone (it holds the write end of a pipe the runner watches), so a killed stage
    leaves no call running without a limit.

The sandbox (where the OS allows it; `sandbox_problem()` says why not): `unshare --user
--map-root-user --net --ipc --pid --fork --kill-child --mount-proc`, the runner the init of the
new PID namespace. When the init ends, the kernel kills every process of the namespace, so
nothing the code starts (children, double forks, `setsid`, daemons, SIGTERM ignored) outlives
the call; `unshare` is killed with its caller's process group as a backstop (`--kill-child`).
Inside: no network (only a loopback interface, down), a /proc of the namespace's own processes
(the stage's are not there to read), the whole file system read-only (mount_setattr, Linux >=
5.12) but for a tmpfs of `disk_mb` MB over /tmp (the working directory and $HOME; the host's
/tmp is hidden and nothing is left on the host's disk) and another over /dev/shm, and a seccomp
filter that refuses Unix sockets (`socket(AF_UNIX)`: no server reached through a socket file),
io_uring, and the mount syscalls (the code cannot unmount its /proc or /tmp, nor remount /).

Not isolated (docs/trajectories.md): reading the file system (the code runs as the caller's
user, mapped to root of its user namespace: it reads what that user can, credential files
included), the CPU and memory of several processes together (each process has its own limits;
their number is not limited), the kernel.

Without the sandbox (`unshare` missing or refused: no user namespaces, some containers) the
Python tool is refused (`require_sandbox`, checked when the environment is loaded) unless the
config opts in to the weaker mode (`generate.tool_sandbox = "weak"`): the code then runs in a new
session whose process group is killed when the call ends (a process that leaves the group
outlives it), with the host's network and a temporary directory on the host's disk.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rlhf_batch.errors import UserError

UNSHARE = ("unshare", "--user", "--map-root-user", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc")
MODES = ("required", "weak")  # generate.tool_sandbox
TMP_PREFIX = "rlhf-batch-tool-"  # the weak mode's folders: TMP_PREFIX<pid of the caller>-<random>
GRACE_S = 5.0  # past the runner's own deadline, the caller kills the runner's process group
_mode = "required"


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    output_bytes: int = 1 << 20  # cap of the output file and of any file written (RLIMIT_FSIZE)
    max_output: int = 4000  # characters of output returned
    timeout_s: float = 10.0  # wall clock; then everything the call started is killed
    isolate_network: bool = True  # a network namespace (in the sandbox)
    disk_mb: int = 64  # the sandbox's /tmp (tmpfs)


@dataclass(frozen=True)
class Result:
    output: str  # stdout and stderr, interleaved, cut to max_output characters
    returncode: int  # negative: killed by that signal
    reason: str  # "ok", "error" (non-zero exit), "timeout", "cpu_limit", "output_limit", "killed"
    truncated: bool
    network_isolated: bool
    sandboxed: bool = True  # in the PID, mount and network namespaces (False: the weak mode)

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


def configure(mode: str) -> None:
    """The sandbox mode of this process's calls (generate.tool_sandbox): "required" refuses to
    run code without the sandbox, "weak" runs it with the process-group kill only."""
    global _mode
    if mode not in MODES:
        raise UserError(f"generate.tool_sandbox: must be one of {', '.join(MODES)}, got {mode!r}")
    _mode = mode


@functools.cache
def sandbox_problem() -> str | None:
    """Why the sandbox cannot run here (None: it can); tried once per process with a real call."""
    try:
        r = _run("print('ok')", Limits(timeout_s=20.0), boxed=True)
    except OSError as e:
        return f"{UNSHARE[0]}: {e.strerror or e}"
    if r.output == "ok\n" and r.returncode == 0:
        return None
    return r.output.strip().splitlines()[-1][:200] if r.output.strip() else f"exit code {r.returncode}"


def require_sandbox() -> None:
    """One line (UserError) where the sandbox cannot run and the weak mode is not chosen."""
    why = sandbox_problem()
    if why is not None and _mode != "weak":
        raise UserError(
            "generate.tool_sandbox: the Python tool runs code only in a sandbox (user, PID, mount and "
            f"network namespaces), which this machine refuses ({why}); set generate.tool_sandbox = "
            '"weak" to run it with a process-group kill only (docs/trajectories.md)'
        )


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run `code` under `limits` (module docstring); never raises for what the code does."""
    require_sandbox()
    return _run(code, limits, boxed=sandbox_problem() is None)


def _run(code: str, limits: Limits, boxed: bool) -> Result:
    with contextlib.ExitStack() as stack:
        if boxed:  # its files live on the namespace's own /tmp
            work, home = None, "/tmp"
        else:
            _remove_stale()
            prefix = f"{TMP_PREFIX}{os.getpid()}-"
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True))
            work = home = tmp
        out = stack.enter_context(tempfile.TemporaryFile())  # unnamed: gone with its last holder
        life_r, life_w = os.pipe()  # the runner ends the call when this process's end closes
        stat_r, stat_w = os.pipe()  # the runner reports how the code ended
        stack.callback(os.close, life_w)
        status_pipe = stack.enter_context(os.fdopen(stat_r, "rb"))
        args = [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.output_bytes), str(limits.disk_mb)]
        args += [str(life_r), str(stat_w), str(int(boxed)), str(limits.timeout_s)]
        runner = [sys.executable, "-I", "-S", "-c", RUNNER, *args, sys.executable, "-I", "-c", code]
        net = ("--net",) if limits.isolate_network else ()
        argv = [*UNSHARE, *net, "--", *runner] if boxed else runner
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                argv,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(life_r, stat_w),
            )
        finally:
            os.close(life_r)
            os.close(stat_w)
        status = _status(proc, status_pipe, limits.timeout_s + GRACE_S)
        out.seek(0)
        raw = out.read()
    text = raw.decode("utf-8", errors="replace")
    truncated = len(text) > limits.max_output
    returncode = int(status.split()[-1]) if status.startswith("exit") else -signal.SIGKILL
    reason = _reason(returncode, status == "timeout", len(raw) >= limits.output_bytes)
    return Result(
        text[: limits.max_output], returncode, reason, truncated, boxed and limits.isolate_network, boxed
    )


@functools.cache
def _remove_stale() -> None:
    """The weak mode's folders of callers that are gone (a killed stage), once per process."""
    import shutil

    for d in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        pid = d.name[len(TMP_PREFIX) :].split("-")[0]
        if not (pid.isascii() and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


def _status(proc: subprocess.Popen, pipe: IO[bytes], wait_s: float) -> str:
    """The runner's report ("exit N", "timeout"); past `wait_s` the runner's group is killed."""
    import selectors

    deadline = time.monotonic() + wait_s
    with selectors.DefaultSelector() as sel:
        sel.register(pipe, selectors.EVENT_READ)
        ready = sel.select(timeout=wait_s)
    status = pipe.read().decode(errors="replace").strip() if ready else "timeout"
    if not ready:
        _kill_group(proc.pid)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 1)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
    if not status:  # the runner did not start (e.g. unshare refused): its own exit code
        status = f"exit {proc.returncode}"
    _kill_group(proc.pid)  # the weak mode: what is left in the code's group is the runner's (gone)
    return status


# The runner: the init of the PID namespace (argv: cpu, memory, file size, tmpfs MB, the lifeline
# and status fds, boxed, timeout, then the code's argv). Boxed, it makes / read-only and mounts the
# tmpfs over /tmp and /dev/shm. It starts the code with
# its limits (and, boxed, the seccomp filter), waits for the first of: the code's end, the deadline,
# the caller's end of the lifeline closing; kills the code's group (the weak mode; boxed, its own
# exit kills the namespace), writes the status, exits. Written for `python -I -S`: no imports of
# the project, no preexec_fn in the caller (not safe in a process with threads).
RUNNER = r"""
import ctypes, os, resource, select, signal, struct, sys, time
cpu, mem, size, disk, life, stat, boxed = map(int, sys.argv[1:8])
timeout, argv = float(sys.argv[8]), sys.argv[9:]
libc = ctypes.CDLL(None, use_errno=True)

def fail(what):
    e = ctypes.get_errno()
    os.write(2, ("sandbox: %s failed: %s\n" % (what, os.strerror(e))).encode())
    os._exit(126)

ARCH = {"x86_64": (0xC000003E, 41, (165, 166, 155, 425, 428, 429, 430, 431, 432, 433, 442)),
        "aarch64": (0xC00000B7, 198, (40, 39, 41, 425, 428, 429, 430, 431, 432, 433, 442))}

def seccomp():
    # socket(AF_UNIX), mount, umount2, pivot_root, io_uring_setup, open_tree, move_mount, fsopen,
    # fsconfig, fsmount, fspick, mount_setattr: EPERM; so is every call of another ABI
    arch, sock, nrs = ARCH[os.uname().machine]
    deny, allow = 0x00050000 | 1, 0x7FFF0000
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, deny), (0x20, 0, 0, 0)]
    if arch == 0xC000003E:
        prog += [(0x35, 0, 1, 0x40000000), (0x06, 0, 0, deny)]
    for nr in nrs:
        prog += [(0x15, 0, 1, nr), (0x06, 0, 0, deny)]
    prog += [(0x15, 0, 3, sock), (0x20, 0, 0, 16), (0x15, 0, 1, 1), (0x06, 0, 0, deny), (0x06, 0, 0, allow)]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    fprog = struct.pack("HP", len(prog), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        fail("no_new_privs")
    if libc.prctl(22, 2, ctypes.c_void_p(ctypes.addressof(fbuf)), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        fail("seccomp")

if boxed:
    if os.uname().machine not in ARCH:
        os.write(2, ("sandbox: no seccomp filter for %s\n" % os.uname().machine).encode())
        os._exit(126)
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", 1, 0, 0, 0))  # MOUNT_ATTR_RDONLY
    if libc.syscall(442, -100, b"/", 0x8000, attr, 32) != 0:  # mount_setattr(AT_FDCWD, AT_RECURSIVE)
        fail("mount_setattr (Linux >= 5.12) of / read-only")
    for where in (b"/tmp", b"/dev/shm"):  # nosuid, nodev
        if os.path.isdir(where) and libc.mount(b"tmpfs", where, b"tmpfs", 2 | 4, b"size=%dm,mode=700" % disk):
            fail("mount " + where.decode())
    os.chdir("/tmp")
pid = os.fork()
if pid == 0:
    try:
        os.close(life)
        os.close(stat)
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if boxed:
            seccomp()
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
code = os.pidfd_open(pid)
deadline = time.monotonic() + timeout
ready = []
while not ready:
    left = deadline - time.monotonic()
    if left <= 0:
        break
    ready = select.select([code, life], [], [], left)[0]
if code in ready:
    status = "exit %d" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
else:  # the code first (not reaped: the pid is still its own; it may not lead its group yet)
    status = "timeout" if not ready else "abandoned"
    os.kill(pid, signal.SIGKILL)
try:
    os.killpg(pid, signal.SIGKILL)  # what is left in its group (a group's id is not reused while it has members)
except OSError:
    pass
os.write(stat, status.encode())
os._exit(0)
"""


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
