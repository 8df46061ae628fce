"""Reward functions: loaded by ``"package.module:function"``, called batched, combined by weight.

A reward function is called once per batch of rollouts with keyword lists (TRL-like)::

    fn(*, prompts: list[str], responses: list[str], prompt_ids: list[list[int]],
       response_ids: list[list[int]], **columns) -> list[float | None]

where ``columns`` are the prompt dataset's columns carried along in the rollouts table (every
column not in ``schemas.ROLLOUTS``, e.g. ``answer``), each a list; functions should accept
``**kwargs``. A function that takes ``completion_messages`` (or ``**kwargs``) also gets each
rollout's response as chat messages: assistant turns with their tool calls, the environment's
messages as tool (or user) messages (data/chat_turns.completion_messages). ``None`` means "cannot score this rollout". Its values go to the column
``reward_<function name>`` (``"package.module:function as NAME"``: ``reward_NAME``; two
functions of one name: ``reward_<module>_<function>``, see load_reward_functions). The weighted sum of all values is ``reward_raw``; a row where any
value is ``None`` has no ``reward_raw``. Light module: no torch import.

A prefix selects another calling convention (see `rlhf_batch.rewards.conventions`):
``"trl:package.module:function"`` is called as TRL's GRPOTrainer calls reward functions and
``"verl:package.module:compute_score"`` as verl's reward manager calls ``compute_score``.
Modules are imported with `score.reward_paths` (default: the config file's directory, then the
current directory) at the end of ``sys.path``, in every mode (`run`, `score`, `--in-process`):
after the standard library and the installed packages, so no file there shadows one of them.
"""

from __future__ import annotations

import contextlib
import importlib
import math as _math  # not `math`: the submodule rlhf_batch.rewards.math would replace it
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from rlhf_batch.errors import ConfigError, RewardError

RM_COLUMN = "rm_score"  # the reward model's end score


CONVENTIONS = ("trl", "verl")  # prefixes of "trl:package.module:function"


@dataclass(frozen=True)
class RewardFunction:
    path: str  # "package.module:function", optionally prefixed "trl:" or "verl:", suffixed " as NAME"
    fn: Callable[..., Any]
    weight: float
    convention: str = ""  # "" (keyword lists, see above), "trl" or "verl"
    alias: str = ""  # the name its column takes (" as NAME", or the naming rule of load_reward_functions)

    @property
    def name(self) -> str:
        return self.alias or given_name(self.path)

    @property
    def column(self) -> str:
        return f"reward_{self.name}"


def strip_alias(path: str, key: str = "score.reward_functions") -> tuple[str, str]:
    """``"verl:pkg.mod:compute_score as gsm8k"`` -> ("verl:pkg.mod:compute_score", "gsm8k")."""
    head, sep, alias = path.rpartition(" as ")
    if not sep:
        return path.strip(), ""
    if not alias.strip().isidentifier():
        raise ConfigError(f"{key}: {path!r}: the name after 'as' must be an identifier")
    return head.strip(), alias.strip()


def given_name(path: str) -> str:
    """The alias of ``"pkg.mod:fn as NAME"``, else the function's name."""
    bare, alias = strip_alias(path)
    return alias or bare.rpartition(":")[2].rpartition(".")[2]


def qualified_name(path: str) -> str:
    """The column name of a function whose name another function has: its module's last part
    and its name (``verl:pkg.gsm8k:compute_score`` -> ``gsm8k_compute_score``)."""
    module, _, attr = split_convention(strip_alias(path)[0])[1].partition(":")
    return f"{module.rpartition('.')[2]}_{attr.rpartition('.')[2]}"


def split_convention(path: str, key: str = "score.reward_functions") -> tuple[str, str]:
    """``"trl:pkg.mod:fn"`` -> ("trl", "pkg.mod:fn"); a path without a prefix -> ("", path).
    Errors name the config `key` that lists the path."""
    path = strip_alias(path, key)[0]
    prefix, sep, rest = path.partition(":")
    if sep and rest.count(":") == 1:
        if prefix not in CONVENTIONS:
            raise ConfigError(
                f"{key}: {path!r}: unknown calling convention {prefix!r} "
                f"(use {', '.join(c + ':' for c in CONVENTIONS)} or none)"
            )
        return prefix, rest
    return "", path


def add_search_path(dirs: Sequence[str]) -> None:
    """Put `dirs` at the end of sys.path (once each), where reward modules are looked up: a
    `tqdm.py` beside the config must not replace the installed tqdm."""
    import sys

    for d in [str(x) for x in dirs if x]:
        if d not in sys.path:
            sys.path.append(d)


def import_function(path: str, key: str = "score.reward_functions") -> Callable[..., Any]:
    """``"package.module:function"`` -> the function; ConfigError naming `key` and the path otherwise."""
    module_name, sep, attr = split_convention(path, key)[1].partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {path!r} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
        raise ConfigError(f"{key}: cannot import {module_name!r} for {path!r} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: {module_name!r} has no attribute {attr!r} ({path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {path!r} is not callable")
    fn: Callable[..., Any] = obj
    return fn


def load_reward_functions(
    paths: Sequence[str],
    weights: Sequence[float] = (),
    reserved: Sequence[str] = (),
    search: Sequence[str] = (),
    key: str = "score.reward_functions",
) -> list[RewardFunction]:
    """Import every function (with `search` dirs at the end of sys.path); weights default to
    1.0. A function's column is ``reward_<name>``: its alias (``"pkg.mod:fn as NAME"``), else its
    function name, else, when another function has that name too, ``<module>_<function>`` (two
    verl ``compute_score`` from ``gsm8k`` and ``math`` modules: ``reward_gsm8k_compute_score``,
    ``reward_math_compute_score``). Columns that still have one name (or a name in `reserved`)
    are a ConfigError. Errors name the config `key` that lists them (`eval.reward_functions`)."""
    add_search_path(search)
    weights = list(weights) or [1.0] * len(paths)
    if len(weights) != len(paths):
        wkey = key.replace("functions", "weights")
        raise ConfigError(f"{wkey}: {len(weights)} weights for {len(paths)} reward_functions")
    names = [given_name(p) for p in paths]
    out: list[RewardFunction] = []
    for path, weight, name in zip(paths, weights, names, strict=True):
        alias = strip_alias(path, key)[1] or (qualified_name(path) if names.count(name) > 1 else "")
        rf = RewardFunction(
            path, import_function(path, key), float(weight), split_convention(path, key)[0], alias
        )
        clash = [o.path for o in out if o.column == rf.column]
        if clash or rf.column in reserved or rf.column == RM_COLUMN:
            other = f"{clash[0]!r}" if clash else "a column of the scores table"
            raise ConfigError(
                f"{key}: {path!r} would write column {rf.column!r}, as does {other}; "
                "name its column with 'MODULE:FUNCTION as NAME'"
            )
        out.append(rf)
    return out


def call_reward_function(
    rf: RewardFunction,
    rollout_ids: Sequence[str],
    *,
    prompts: list[str],
    responses: list[str],
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    columns: dict[str, list[Any]],
    completion_messages: list[list[dict[str, Any]]] | None = None,
) -> list[float | None]:
    """Call `rf` on a batch; RewardError naming the function and the rollout when it raises,
    returns the wrong number of values, a non-number, NaN or inf. `completion_messages` (each
    rollout's response as messages) is passed to a function that takes it (by name or **kwargs)."""
    kwargs = {
        **columns,
        "prompts": prompts,
        "responses": responses,
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
    }
    if completion_messages is not None and takes(rf.fn, "completion_messages"):
        kwargs["completion_messages"] = completion_messages
    return call_batched(rf, rollout_ids, kwargs)


def takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` takes keyword argument `name` (a parameter of that name, or **kwargs)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin: give it only what it always got
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def call_batched(
    rf: RewardFunction, rollout_ids: Sequence[str], kwargs: dict[str, Any]
) -> list[float | None]:
    """`rf.fn(**kwargs)` on a batch of keyword lists, its values checked (see call_reward_function)."""
    try:
        values = rf.fn(**kwargs)
    except SystemExit as e:  # must not end the stage as if it had succeeded
        raise RewardError(f"reward function {rf.path} called sys.exit({e.code!r})") from None
    except Exception as e:  # noqa: BLE001 - a user function: report it with the rollout
        bad = _failing_rollout(rf, kwargs, rollout_ids)
        msg = str(e).splitlines()[0] if str(e) else ""
        raise RewardError(
            f"reward function {rf.path} raised {type(e).__name__}: {msg} (rollout {bad})"
        ) from e
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != len(rollout_ids):
        got = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise RewardError(
            f"reward function {rf.path} returned {got} values for {len(rollout_ids)} rollouts "
            f"({rollout_ids[0] if rollout_ids else ''}...); it must return one float or None per rollout"
        )
    return check_values(rf, rollout_ids, values)


def check_values(rf: RewardFunction, rollout_ids: Sequence[str], values: Sequence[Any]) -> list[float | None]:
    """Floats (or None), one per rollout; RewardError naming the rollout of a bad value."""
    out: list[float | None] = []
    for rid, v in zip(rollout_ids, values, strict=True):
        if v is not None and (isinstance(v, bool) or not isinstance(v, Real) or not _math.isfinite(v)):
            raise RewardError(
                f"reward function {rf.path} returned {v!r} for rollout {rid}; expected a finite float or None"
            )
        out.append(None if v is None else float(v))
    return out


def _failing_rollout(rf: RewardFunction, kwargs: dict[str, list[Any]], rollout_ids: Sequence[str]) -> str:
    """The first rollout the function fails on when called on it alone."""
    for i, rid in enumerate(rollout_ids):
        try:
            rf.fn(**{k: v[i : i + 1] for k, v in kwargs.items()})
        except Exception:  # noqa: BLE001
            return rid
    return f"{rollout_ids[0]}..{rollout_ids[-1]}, fails only on the whole batch" if rollout_ids else "none"


class _TimedOut(BaseException):  # not an Exception: a reward function's `except Exception` lets it pass
    pass


def _ignore(signum: int, frame: Any) -> None:
    pass


@contextlib.contextmanager
def time_limit(seconds: float, message: str) -> Iterator[None]:
    """Run the block for at most `seconds` (0: no limit): a watchdog thread then interrupts the
    main thread with SIGUSR2 (which also ends a blocking sleep or read) and the block fails with
    RewardError(message). Only on the main thread of a POSIX process; elsewhere no limit."""
    import signal
    import threading

    if (
        seconds <= 0
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "pthread_kill")
    ):
        yield
        return
    fired, done = threading.Event(), threading.Event()

    def handler(signum: int, frame: Any) -> None:
        if fired.is_set() and not done.is_set():
            raise _TimedOut

    def watch(main: int) -> None:
        if not done.wait(seconds):
            fired.set()
            signal.pthread_kill(main, signal.SIGUSR2)

    old = signal.signal(signal.SIGUSR2, handler)
    watcher = threading.Thread(target=watch, args=(threading.get_ident(),), daemon=True)
    watcher.start()
    try:
        yield
    except _TimedOut:
        raise RewardError(message) from None
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGUSR2, _ignore if fired.is_set() else old)  # a signal still on its way


def weighted_sum(
    values: dict[str, list[float | None]], weights: dict[str, float], n: int
) -> list[float | None]:
    """reward_raw per row: sum over columns of weight * value; None when any value is None."""
    out: list[float | None] = []
    for i in range(n):
        row = [(w, values[c][i]) for c, w in weights.items()]
        out.append(
            None if any(v is None for _, v in row) else _math.fsum(w * v for w, v in row if v is not None)
        )
    return out


def clip(x: float | None, c: float) -> float | None:
    """Clip to [-c, c] (c = score_clip, as RolloutFromModel does); c == 0 disables."""
    if x is None or c <= 0:
        return x
    return min(max(x, -c), c)
