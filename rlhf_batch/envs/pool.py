"""Environment steps in worker processes, each call under a time limit.

`EnvPool(ref, workers, timeout)` starts `workers` processes (spawned: they share nothing with the
sampling process but the factory's module). `step(calls)` runs one environment step per call,
`Call(key, row, texts)`: the trajectory `key`'s environment (made once by `factory(row)` in the
worker that holds it) answers the last assistant text. A worker keeps the environments it made
(key -> environment and the texts it has seen); an environment it does not hold, or holds at
another turn (after a resume, or after its worker was replaced), is made again and replayed: the
earlier texts stepped again, their steps dropped. So an environment must be a function of its row
and the assistant texts so far (deterministic), which also makes a resumed run identical.

A call that raises, returns anything but a `Step` (an observation not a str or a list of str, an unknown role, a
reward part not a finite number), takes longer than `timeout` seconds (its worker is killed and
replaced) or kills its worker gives an `Outcome` with `error` set, never an exception: the
trajectory ends there with that reason.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rlhf_batch.envs.base import Step
from rlhf_batch.errors import UserError

ROLES = ("tool", "user")


@dataclass(frozen=True)
class Call:
    key: str  # the trajectory (rollout id)
    row: dict[str, Any]  # the prompt row the factory gets
    texts: tuple[str, ...]  # every assistant text so far; the last one is answered


@dataclass
class Outcome:
    step: Step | None = None
    error: str | None = None  # why the trajectory ends early (None: a good step)
    seconds: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)


def load_factory(ref: str, tool_sandbox: str = "required") -> Any:
    """The callable `module:factory` names; UserError (one line) naming generate.environment,
    whatever its module raises at import. The single place environments are loaded: where the
    module uses the Python tool (envs/python_tool.py imported), its sandbox is checked here too
    (`tool_sandbox`: generate.tool_sandbox)."""
    mod_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a module may raise anything at import
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UserError(f"generate.environment: cannot load {ref!r} ({type(e).__name__}: {why})") from None
    if not callable(obj):
        raise UserError(f"generate.environment: {ref!r} is not callable")
    if "rlhf_batch.envs.python_tool" in sys.modules:
        from rlhf_batch.envs import python_tool

        python_tool.configure(tool_sandbox)
        python_tool.require_sandbox()
    return obj


def _check(step: Any) -> str | None:
    """What is wrong with an environment's answer (None: a good Step)."""
    if not isinstance(step, Step):
        return f"the environment returned {type(step).__name__}, not a Step"
    obs = step.observation
    if isinstance(obs, list) and not all(isinstance(o, str) for o in obs):
        return f"observation holds {type(next(o for o in obs if not isinstance(o, str))).__name__}, not str"
    if obs is not None and not isinstance(obs, str | list):
        return f"observation is {type(obs).__name__}, not str"
    if step.role not in ROLES:
        return f"role {step.role!r} is not one of {', '.join(ROLES)}"
    parts = step.reward_parts
    if not isinstance(parts, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v) for k, v in parts.items()
    ):
        return "reward_parts must map names to finite numbers"
    if (
        isinstance(step.reward, bool)
        or not isinstance(step.reward, int | float)
        or not math.isfinite(step.reward)
    ):
        return f"reward is {step.reward!r}, not a finite number"
    return None


def _answer(factory: Any, envs: dict[str, Any], call: Call) -> tuple[Any, ...]:
    """One call in the worker: ("ok", observation, role, done, parts, reward) or ("error", message)."""
    held = envs.get(call.key)
    try:
        if held is None or held[1] != len(call.texts) - 1:  # made again, earlier texts replayed
            held = [factory(call.row), 0]
            for text in call.texts[:-1]:
                held[0].step(text)
                held[1] += 1
            envs[call.key] = held
        step = held[0].step(call.texts[-1])
        held[1] += 1
    except Exception as e:  # noqa: BLE001 - any failure of the environment ends its trajectory, not the stage
        envs.pop(call.key, None)
        return ("error", f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    bad = _check(step)
    if bad:
        return ("error", bad)
    parts = {k: float(v) for k, v in step.reward_parts.items()}
    return ("ok", step.observation, step.role, bool(step.done), parts, float(step.reward))


def _worker(ref: str, tool_sandbox: str, conn: Any, tool_parser: str) -> None:
    from rlhf_batch.envs.tool_calls import use_format

    own_group()
    use_format(tool_parser)  # what a ToolEnvironment reads calls in (generate.tool_parser)
    factory = load_factory(ref, tool_sandbox)
    envs: dict[str, Any] = {}
    conn.send("ready")  # the time limit of a call starts when the worker can take it
    while True:
        call = conn.recv()
        if call is None:
            return
        t0 = time.perf_counter()
        answer = _answer(factory, envs, call)
        conn.send((*answer, time.perf_counter() - t0))


def own_group() -> None:
    """In a worker: die with the process that started it (Linux PR_SET_PDEATHSIG), and lead a
    process group of its own whose every process a watchdog kills when the worker ends, however
    it ends: what an environment starts (a server, a helper) does not outlive the stage."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing as mp

    from rlhf_batch.runtime.procgroup import start_watchdog

    parent = mp.parent_process()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent.pid:  # the stage died before the prctl took effect
        os._exit(1)
    os.setpgid(0, 0)
    start_watchdog()


class EnvPool:
    def __init__(
        self,
        ref: str,
        workers: int,
        timeout: float,
        tool_sandbox: str = "required",
        tool_parser: str = "hermes",
    ):
        import multiprocessing as mp

        load_factory(ref, tool_sandbox)  # a bad name fails here, in one line, before any worker starts
        self.ref, self.timeout, self.ctx = ref, timeout, mp.get_context("spawn")
        self.tool_sandbox, self.tool_parser = tool_sandbox, tool_parser
        self.procs: list[Any] = [None] * workers
        self.conns: list[Any] = [None] * workers
        for w in range(workers):
            self._start(w)

    def _start(self, w: int) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_worker, args=(self.ref, self.tool_sandbox, child, self.tool_parser), daemon=True
        )
        proc.start()
        child.close()
        self.procs[w], self.conns[w] = proc, parent
        try:
            parent.recv()  # "ready": started, the factory's module imported
        except (EOFError, OSError):
            proc.join()
            raise UserError(
                f"generate.environment: the worker process for {self.ref!r} exited at start "
                f"(exit code {proc.exitcode})"
            ) from None

    def _replace(self, w: int) -> None:
        self.procs[w].kill()
        self.procs[w].join()
        self.conns[w].close()
        self._start(w)

    def step(self, calls: list[Call], workers: list[int]) -> list[Outcome]:
        """One Outcome per call; call i runs in worker workers[i] % len(pool) (the same worker
        for a trajectory's every turn keeps its environment)."""
        from multiprocessing.connection import wait

        n = len(self.procs)
        queues: list[list[int]] = [[] for _ in range(n)]
        for i, w in enumerate(workers):
            queues[w % n].append(i)
        out: list[Outcome] = [Outcome() for _ in calls]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (call, its start)

        def feed(w: int) -> None:
            if queues[w]:
                i = queues[w].pop(0)
                self.conns[w].send(calls[i])
                busy[w] = (i, time.monotonic())

        for w in range(n):
            feed(w)
        while busy:
            limit = None
            if self.timeout:
                limit = max(0.0, min(t0 for _, t0 in busy.values()) + self.timeout - time.monotonic())
            ready = wait([self.conns[w] for w in busy], timeout=limit)
            now = time.monotonic()
            for w in list(busy):
                i, t0 = busy[w]
                if self.conns[w] in ready:
                    out[i] = self._receive(w, now - t0)
                elif self.timeout and now - t0 >= self.timeout:
                    out[i] = Outcome(error=f"timed out after {self.timeout:g} s", seconds=now - t0)
                    self._replace(w)
                else:
                    continue
                del busy[w]
                feed(w)
        return out

    def _receive(self, w: int, waited: float) -> Outcome:
        try:
            msg = self.conns[w].recv()
        except (EOFError, OSError):
            self.procs[w].join()
            code = self.procs[w].exitcode
            self._replace(w)
            return Outcome(error=f"the environment's process died (exit code {code})", seconds=waited)
        if msg[0] == "error":
            return Outcome(error=msg[1], seconds=msg[-1])
        _, obs, role, done, parts, reward, seconds = msg
        return Outcome(Step(obs, role, done, parts, reward), seconds=seconds, reward_parts=parts)

    def close(self) -> None:
        for w, proc in enumerate(self.procs):
            with contextlib.suppress(OSError):  # a worker that died already
                self.conns[w].send(None)
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
                proc.join()
