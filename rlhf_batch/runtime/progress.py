"""Progress of a stage: tqdm bars on a terminal, plain log lines anywhere else.

Under cron, Airflow or `> log`, stderr is not a terminal and carriage-return bar updates would
fill the log; there a stage writes one line every ``RLHF_BATCH_PROGRESS_SECONDS`` (default 10)
seconds and one summary line when it ends::

    score: 4100/12300 tok (33%), 812 tok/s, ETA 0:00:10
    score: done 12300/12300 tok in 0:00:15 (820 tok/s)

`progress_bar` takes tqdm's arguments, so a call site swaps ``tqdm(...)`` for it unchanged.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Any

INTERVAL_ENV = "RLHF_BATCH_PROGRESS_SECONDS"


def terminal_bar(*args: Any, **kwargs: Any) -> Any:
    """A tqdm bar whose rate and ETA are measured from its first update, as LineProgress's: the
    unit that paid the warm-up (a model's first batch, its allocations) does not set the pace of
    the rest (a 1.5-minute stage's first ETA said 8 minutes)."""
    from tqdm import tqdm
    from tqdm.std import EMA

    class Bar(tqdm):  # type: ignore[misc, type-arg]
        measured = False

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            first: float = self.initial  # type: ignore[has-type]
            if not self.measured and self.n > first:
                self.measured = True
                self.initial, self.start_t = self.n, self._time()  # rate = (n - initial) / elapsed
                self.last_print_n, self.last_print_t = self.n, self.start_t
                self._ema_dn, self._ema_dt = EMA(0), EMA(0)  # empty: tqdm falls back to the above
            return shown

    kwargs.setdefault("smoothing", 0)  # the average since the first update, not the last few
    return Bar(*args, **kwargs)


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """A tqdm bar when the output (stderr unless `file=`) is a terminal, else a LineProgress."""
    out = kwargs.get("file") or sys.stderr
    if _isatty(out):
        return terminal_bar(*args, **kwargs)
    return LineProgress(
        total=kwargs.get("total"),
        desc=kwargs.get("desc") or "progress",
        unit=kwargs.get("unit") or "it",
        initial=kwargs.get("initial") or 0,
        disable=bool(kwargs.get("disable")),
        file=out,
    )


def _isatty(f: Any) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, "10")))
    except ValueError:
        return 10.0


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _num(x: float) -> str:
    """1234 -> '1.2k', as tqdm's unit_scale."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class LineProgress:
    """tqdm's update / set_postfix / close, written as one line per interval plus a summary."""

    def __init__(
        self,
        total: float | None,
        desc: str,
        unit: str,
        initial: float = 0,
        disable: bool = False,
        file: IO[str] | None = None,
        interval: float | None = None,
    ):
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.n = initial
        self.initial = initial
        self.file = file or sys.stderr
        self.interval = _interval() if interval is None else interval
        self.start = self.last = time.monotonic()
        self.first: tuple[float, float] | None = None  # (time, n) of the first update: ETA's start
        self.postfix = ""
        self.closed = False

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:  # interrupted or failed: no "done" line, the error says what happened
            self.closed = True

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.first is None:
            self.first = (now, self.n)
        if now - self.last >= self.interval:
            self.last = now
            self._write(self.line(now))

    def refresh(self) -> None:
        """tqdm's redraw after `total`, `n` or `initial` were set: the next line shows them."""

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def rate(self, now: float) -> float:
        elapsed = now - self.start
        return (self.n - self.initial) / elapsed if elapsed > 0 else 0.0

    def eta(self, now: float) -> float | None:
        """Seconds left at the rate since the first update: the first unit's one-time costs
        (warm-up, the longest prompts decoded first) do not inflate it. None until measured."""
        if self.first is None or now <= self.first[0] or self.n <= self.first[1]:
            return None
        rate = (self.n - self.first[1]) / (now - self.first[0])
        return max(0.0, self.total - self.n) / rate if self.total else None

    def line(self, now: float) -> str:
        """`desc: done/total unit (pct), rate unit/s, ETA h:mm:ss[, postfix]`."""
        rate = self.rate(now)
        parts = [
            f"{self.desc}: {self.done()} ({100 * self.n / self.total:.0f}%)"
            if self.total
            else f"{self.desc}: {self.done()}"
        ]
        parts.append(f"{_num(rate)} {self.unit}/s")
        if self.total and (eta := self.eta(now)) is not None:
            parts.append(f"ETA {_clock(eta)}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def done(self) -> str:
        """`n/total unit`, exact counts (or `n unit` without a total)."""
        total = f"/{_count(self.total)}" if self.total else ""
        return f"{_count(self.n)}{total} {self.unit}"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        now = time.monotonic()
        summary = (
            f"{self.desc}: done {self.done()} in {_clock(now - self.start)} "
            f"({_num(self.rate(now))} {self.unit}/s)"
        )
        self._write(summary + (f", {self.postfix}" if self.postfix else ""))

    def _write(self, text: str) -> None:
        if not self.disable:
            print(text, file=self.file, flush=True)


class Rate:
    """A rate shown beside a bar (`tok_s`): every unit so far over the time since the first `add`
    began, so one short step or batch does not swing it."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.n = 0.0

    def begin(self) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def add(self, n: float) -> Rate:
        self.begin()
        self.n += n
        return self

    def __format__(self, spec: str) -> str:
        elapsed = time.perf_counter() - (self.start or time.perf_counter())
        return format(self.n / elapsed if elapsed > 0 else 0.0, spec or ".0f")
