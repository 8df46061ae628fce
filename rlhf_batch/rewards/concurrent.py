"""`async def` reward functions: called once per rollout, concurrently, under a rate limit.

A reward function defined with ``async def`` (or an object whose ``__call__`` is) is awaited once
per rollout, with the arguments its calling convention gives a one-rollout batch (ours and
``trl:``: lists of one element, returning a list of one value; ``verl:``: as always, one call per
rollout), at most `score.reward_concurrency` calls in flight and at most
`score.reward_rate_per_s` calls started per second (0: no limit): an LLM judge or a sandbox
behind an API. Each result is checked as a synchronous function's (rewards.conventions) and the
values come back in row order, so they do not depend on which call finished first.

Plain (synchronous) functions are called as before: once per batch (verl: per rollout, in order).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from rlhf_batch.errors import RewardError
from rlhf_batch.rewards import RewardFunction
from rlhf_batch.rewards.conventions import Extras, evaluate_rows


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` returns a coroutine: an ``async def`` function or ``__call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class Pacer:
    """Start times at least 1 / rate apart (rate 0: no limit), in the order calls ask."""

    def __init__(self, rate_per_s: float):
        self.gap = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
        self.next = 0.0

    async def wait(self) -> None:
        if not self.gap:
            return
        now = time.monotonic()
        start = max(now, self.next)
        self.next = start + self.gap
        if start > now:
            await asyncio.sleep(start - now)


async def gather_limited(
    calls: Sequence[Callable[[], Awaitable[Any]]], concurrency: int, rate_per_s: float
) -> list[Any]:
    """Await every call, at most `concurrency` at once, started at most `rate_per_s` a second;
    results in the order of `calls`."""
    gate = asyncio.Semaphore(max(1, concurrency))
    pacer = Pacer(rate_per_s)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            await pacer.wait()
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


def _row(batch: dict[str, Any], i: int) -> dict[str, Any]:
    """Row i of a batch (call_reward_function's keyword arguments) as a batch of one."""
    out = {k: v[i : i + 1] for k, v in batch.items() if k != "columns"}
    out["columns"] = {c: v[i : i + 1] for c, v in batch["columns"].items()}
    return out


def async_rows(
    rf: RewardFunction,
    rollout_ids: Sequence[str],
    batch: dict[str, Any],
    concurrency: int,
    rate_per_s: float,
) -> tuple[list[float | None], list[Extras] | None]:
    """evaluate_rows for an async function: one awaited call per rollout (see the module)."""
    rows = [_row(batch, i) for i in range(len(rollout_ids))]
    kwargs: list[dict[str, Any]] = []

    def record(**kw: Any) -> Any:  # the arguments the convention passes, a placeholder result
        kwargs.append(kw)
        return 0.0 if rf.convention == "verl" else [0.0]

    for rid, row in zip(rollout_ids, rows, strict=True):
        evaluate_rows(replace(rf, fn=record), [rid], **row)

    async def call(i: int) -> Any:
        try:
            return await rf.fn(**kwargs[i])
        except Exception as e:  # noqa: BLE001 - a user function: report it with the rollout
            msg = str(e).splitlines()[0] if str(e) else ""
            raise RewardError(
                f"reward function {rf.path} raised {type(e).__name__}: {msg} (rollout {rollout_ids[i]})"
            ) from e

    calls = [lambda i=i: call(i) for i in range(len(rows))]
    results = asyncio.run(gather_limited(calls, concurrency, rate_per_s)) if calls else []
    values: list[float | None] = []
    more: list[Extras] = []
    for rid, row, result in zip(rollout_ids, rows, results, strict=True):
        v, m = evaluate_rows(replace(rf, fn=lambda _r=result, **_: _r), [rid], **row)
        values += v
        more += m or [{}]
    return values, (more if rf.convention == "verl" else None)
