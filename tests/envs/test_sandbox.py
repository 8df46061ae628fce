"""The Python tool's sandbox, tried as model-written code would: nothing the code starts (forks,
double forks, setsid, setpgid, a daemon, SIGTERM ignored) outlives its call, whether the call
returns, times out or its caller is SIGKILLed (a process calling the tool, an environment pool's
stage, `run`); then each line of what it isolates and what it does not (docs/trajectories.md).
Processes are found by a marker in their command line, in /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlhf_batch.envs import python_tool
from rlhf_batch.envs.base import Step
from rlhf_batch.envs.pool import load_factory
from rlhf_batch.envs.python_tool import Limits, run_python, sandbox_problem
from rlhf_batch.errors import UserError
from tests.envs.test_tools import listener

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux /proc"),
    pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}"),
]

LIMITS = Limits(cpu_s=2, memory_mb=256, output_bytes=64_000, max_output=2000, timeout_s=20.0)
ROOT = Path(__file__).resolve().parents[2]

# a process that holds on: SIGTERM ignored, its name (argv[2]) written to its working directory
HOLD = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[2], 'w').close(); time.sleep(300)"
)
ESCAPE = """
import os, signal, sys, time
HOLD, MARK = {hold!r}, {mark!r}
def start(how):
    if os.fork():
        return
    if how in ("setsid", "daemon"):
        os.setsid()
    if how == "setpgid":
        os.setpgid(0, 0)
    if how == "daemon" and os.fork():  # the double fork: the middle process exits
        os._exit(0)
    os.execv(sys.executable, [sys.executable, "-c", HOLD, MARK, how])
HOWS = ("fork", "setsid", "setpgid", "daemon")
for how in HOWS:
    start(how)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
while not all(os.path.exists(h) for h in HOWS):
    time.sleep(0.01)
print("started", flush=True)
time.sleep({sleep})
"""


def escape(mark: str, sleep: float) -> str:
    return ESCAPE.format(hold=HOLD, mark=mark, sleep=sleep)


def marked(mark: str) -> list[int]:
    """The live processes (not zombies) whose command line holds `mark`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark.encode() not in (d / "cmdline").read_bytes():
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(d.name))
        except OSError:  # gone meanwhile
            continue
    return out


def wait_until(predicate, seconds: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_nothing_the_code_starts_outlives_a_call_that_returns() -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    r = run_python(escape(mark, 0), LIMITS)
    assert (r.reason, r.output, r.sandboxed) == ("ok", "started\n", True)
    assert wait_until(lambda: not marked(mark), 2.0), marked(mark)


def test_nothing_the_code_starts_outlives_a_call_that_times_out() -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    results = []
    call = threading.Thread(
        target=lambda: results.append(run_python(escape(mark, 300), Limits(timeout_s=5.0)))
    )
    call.start()
    # the code and its four holders run (the daemon's middle process has exited)
    assert wait_until(lambda: len(marked(mark)) >= 5, 5.0), marked(mark)
    call.join()
    assert results[0].reason == "timeout" and results[0].output == "started\n"
    assert wait_until(lambda: not marked(mark), 2.0), marked(mark)


STAGE = """
import sys
from rlhf_batch.envs.python_tool import Limits, run_python
run_python(sys.argv[1], Limits(cpu_s=2, memory_mb=256, timeout_s=300.0))
"""


def test_nothing_outlives_a_sigkill_of_the_calling_process() -> None:
    """The caller is gone; the runner sees its end of the lifeline close and ends the call at once
    (not at the 300 s wall-clock limit), with everything in it; no temporary folder is left."""
    mark = f"mark-{uuid.uuid4().hex}"
    before = set(os.listdir(tempfile.gettempdir()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", STAGE, escape(mark, 300)], env=env)
    try:
        assert wait_until(lambda: len(marked(mark)) >= 5, 30), marked(mark)
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not marked(mark), 5.0), marked(mark)
    finally:
        proc.kill()
    left = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("rlhf-batch-tool-")}
    assert left == set()


class Escaping:
    """An environment that starts a helper of its own (as a tool server would) and runs the
    escaping code in the Python tool at each step; the marker comes from the stage's environment."""

    def __init__(self, row: dict) -> None:
        self.mark = os.environ["SANDBOX_TEST_MARK"]
        subprocess.Popen([sys.executable, "-c", HOLD, self.mark, "helper"], cwd=tempfile.mkdtemp())

    def step(self, text: str) -> Step:
        return Step(
            run_python(escape(self.mark, 300), Limits(cpu_s=2, memory_mb=256, timeout_s=300.0)).text()
        )


def escaping(row: dict) -> Escaping:
    return Escaping(row)


POOL_STAGE = """
from rlhf_batch.envs.pool import Call, EnvPool
pool = EnvPool("tests.envs.test_sandbox:escaping", 1, timeout=300.0)
pool.step([Call("r0", {}, ("a",))], [0])
"""


def test_nothing_outlives_a_sigkill_of_a_stage_with_an_environment_pool() -> None:
    """The stage's pool worker dies with it (parent-death signal); the helper the environment
    started dies with the worker's group (its watchdog), the tool's call with its lifeline."""
    mark = f"mark-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SANDBOX_TEST_MARK": mark}
    proc = subprocess.Popen([sys.executable, "-c", POOL_STAGE], env=env)
    try:
        assert wait_until(lambda: len(marked(mark)) >= 6, 60), marked(mark)  # the helper, the code, 4 holders
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not marked(mark), 10.0), marked(mark)
    finally:
        proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("in_process", [False, True], ids=["stage-process", "in-process"])
def test_nothing_outlives_a_sigkill_of_run_during_multi_turn_generate(make_config, in_process: bool) -> None:
    """`rlhf-batch run` SIGKILLed while its generate stage's environment runs the tool: the stage
    in a process of its own, or in `run`'s."""
    from tests.reliability.harness import environment

    mark = f"mark-{uuid.uuid4().hex}"
    generate = {"environment": "tests.envs.test_sandbox:escaping"}
    path, _ = make_config(iterations=1, threads=1, in_process=in_process, generate=generate)
    env = {**environment(), "SANDBOX_TEST_MARK": mark}
    cmd = [sys.executable, "-m", "rlhf_batch", "run", str(path), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: len(marked(mark)) >= 6, 300), marked(mark)
        proc.kill()
        assert proc.wait() == -signal.SIGKILL
        assert wait_until(lambda: not marked(mark), 10.0), marked(mark)
    finally:
        proc.kill()


# ---------------------------------------------------------------- what it isolates (docs/trajectories.md)
def test_the_stages_environment_variables_are_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in the code's environment, not in any /proc/*/environ it can read, not after an attempt
    to unmount its /proc (refused) to reach the host's."""
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    code = f"""
import ctypes, os
print(sorted(os.environ))
seen = []
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            seen.append(open(f"/proc/{{p}}/environ", "rb").read())
        except OSError:
            pass
print(len(seen), any({secret.encode()!r} in s for s in seen))
libc = ctypes.CDLL(None, use_errno=True)
print(libc.umount2(b"/proc", 2), os.strerror(ctypes.get_errno()))  # MNT_DETACH
print(os.getppid(), sorted(int(p) for p in os.listdir("/proc") if p.isdigit())[:3])
"""
    r = run_python(code, LIMITS)
    assert r.output.splitlines() == [
        "['HOME', 'LANG', 'PATH']",
        "2 False",  # the runner's and the code's own: the stage's processes are not in this /proc
        "-1 Operation not permitted",
        "1 [1, 2]",  # its parent is the runner, the namespace's init
    ], r.output


def test_no_server_is_reached_through_a_unix_socket() -> None:
    """A socket file the code can see (outside /tmp and /dev/shm, its own) and an abstract one:
    creating a Unix socket is refused (seccomp), so neither server hears from it."""
    folder = Path(tempfile.mkdtemp(dir="/var/tmp"))
    path = str(folder / "s")
    abstract = f"\0rlhf-batch-test-{uuid.uuid4().hex}"
    srv, accepted = listener(socket.AF_UNIX, path)
    asrv, aaccepted = listener(socket.AF_UNIX, abstract)
    code = f"""
import os, socket
print(os.path.exists({path!r}))
for where in ({path!r}, {abstract!r}):
    try:
        socket.socket(socket.AF_UNIX).connect(where)
        print("connected")
    except OSError as e:
        print(type(e).__name__)
"""
    try:
        r = run_python(code, LIMITS)
    finally:
        srv.close()
        asrv.close()
        os.unlink(path)
        folder.rmdir()
    assert r.output == "True\nPermissionError\nPermissionError\n", r.output
    assert accepted == [] and aaccepted == []


def test_files_outside_its_tmp_can_be_read_not_written_and_the_hosts_tmp_is_hidden() -> None:
    """Not isolated: reading what the caller's user can (here a file of the project); writing
    anywhere but its own /tmp and /dev/shm is refused (read-only); the host's /tmp is not there."""
    outside = Path(tempfile.mkdtemp(dir="/var/tmp"))
    in_tmp = Path(tempfile.mkdtemp(dir="/tmp"))
    (in_tmp / "f").write_text("host tmp")
    code = f"""
import os
print(open({str(ROOT / "pyproject.toml")!r}).readline().strip())
for path in ({str(outside / "written")!r}, {str(ROOT / "written-by-the-tool")!r}, "/dev/shm/x", "x"):
    try:
        open(path, "w").write("from the tool")
        print("wrote", path)
    except OSError as e:
        print(e.strerror)
print(os.path.exists({str(in_tmp / "f")!r}), sorted(os.listdir("/tmp")))
"""
    try:
        r = run_python(code, LIMITS)
    finally:
        (in_tmp / "f").unlink()
        in_tmp.rmdir()
        outside.rmdir()  # fails if the tool wrote in it
    first = (ROOT / "pyproject.toml").read_text().splitlines()[0].strip()
    want = [
        first,
        "Read-only file system",
        "Read-only file system",
        "wrote /dev/shm/x",
        "wrote x",
        "False ['x']",
    ]
    assert r.output.splitlines() == want, r.output
    assert not (ROOT / "written-by-the-tool").exists()


def test_cpu_and_memory_limits_bind_each_process_not_their_sum() -> None:
    """Not isolated: three processes each take 150 MB (450 MB together, over the 256 MB limit of
    each) and 1.2 s of CPU each (over 2 s together), and all finish."""
    code = """
import os, time
def work():
    x = bytearray(150 << 20)
    t = time.process_time()
    while time.process_time() - t < 1.2:
        pass
    return len(x)
pids = [os.fork() for _ in range(2)]
if 0 in pids:
    work()
    os._exit(0)
work()
print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
"""
    r = run_python(code, Limits(cpu_s=2, memory_mb=256, timeout_s=30.0))
    # the first fork's child forks again: 1 + 1 + 2 = 4 processes; the parent reports its 2
    assert (r.reason, r.output) == ("ok", "[0, 0]\n"), r.output


def test_its_tmp_is_bounded_and_gone_with_the_call() -> None:
    code = """
import os
n = 0
try:
    while True:
        with open(f"f{n}", "wb") as f:
            f.write(b"x" * (3 << 20))
        n += 1
except OSError as e:
    print(n, e.strerror)
"""
    r = run_python(code, Limits(cpu_s=2, memory_mb=256, output_bytes=4 << 20, disk_mb=8, timeout_s=20.0))
    assert r.output == "2 No space left on device\n", r.output  # 8 MB hold two 3 MB files
    assert run_python("import os; print(os.listdir('.'))", LIMITS).output == "[]\n"


# ---------------------------------------------------------------- without the sandbox
@pytest.fixture
def no_sandbox(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """This machine as one without `unshare` (or with user namespaces refused)."""
    monkeypatch.setattr(python_tool, "UNSHARE", ("/nonexistent/unshare",))
    python_tool.sandbox_problem.cache_clear()
    yield
    python_tool.configure("required")
    python_tool.sandbox_problem.cache_clear()


def test_without_the_sandbox_the_tool_is_refused_in_one_line(no_sandbox) -> None:  # noqa: ANN001
    assert sandbox_problem() == "/nonexistent/unshare: No such file or directory"
    with pytest.raises(UserError) as e:
        load_factory("rlhf_batch.envs.tools:tool_environment")
    line = str(e.value)
    assert "\n" not in line and 'set generate.tool_sandbox = "weak"' in line, line
    with pytest.raises(UserError, match="generate.tool_sandbox"):
        run_python("print(1)", LIMITS)


def test_the_weak_mode_runs_the_code_on_the_hosts_network(no_sandbox, tmp_path: Path) -> None:  # noqa: ANN001
    """Opted in: no namespaces (the host's network and /tmp); the call's limits still hold."""
    load_factory("rlhf_batch.envs.tools:tool_environment", "weak")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=3)\nprint('ok')"
        r = run_python(code, LIMITS)
    finally:
        srv.close()
    assert (r.reason, r.output, r.sandboxed, r.network_isolated) == ("ok", "ok\n", False, False)
    slow = run_python("import time; time.sleep(60)", Limits(cpu_s=1, memory_mb=256, timeout_s=1.0))
    assert slow.reason == "timeout" and not slow.sandboxed


WEAK_STAGE = """
import sys
from rlhf_batch.envs import python_tool
python_tool.UNSHARE = ("/nonexistent/unshare",)
python_tool.configure("weak")
python_tool.run_python(sys.argv[1], python_tool.Limits(timeout_s=300.0))
"""


def test_the_weak_mode_ends_the_call_of_a_killed_caller_and_removes_its_folder_later(no_sandbox) -> None:  # noqa: ANN001
    """The caller SIGKILLed: its runner ends the code at once (not at the 300 s limit); the folder
    the caller could not remove is removed by the next caller's first call."""
    mark = f"mark-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WEAK_STAGE, f"import time; time.sleep(300)  # {mark}"], env=env
    )
    folders = lambda: list(Path(tempfile.gettempdir()).glob(f"rlhf-batch-tool-{proc.pid}-*"))  # noqa: E731
    try:
        assert wait_until(lambda: len(marked(mark)) >= 3 and folders(), 30), marked(
            mark
        )  # caller, runner, code
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not marked(mark), 5.0), marked(mark)
    finally:
        proc.kill()
    assert len(folders()) == 1
    python_tool.configure("weak")
    python_tool._remove_stale.cache_clear()
    assert run_python("print(1)", LIMITS).output == "1\n"
    assert folders() == []
