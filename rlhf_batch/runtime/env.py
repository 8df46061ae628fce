"""Numbers read from environment variables: a value that is not one is a one-line error naming
the variable, checked when a command starts (`check`), not when a rare path first reads it."""

from __future__ import annotations

import math
import os

from rlhf_batch.errors import UserError

SECONDS = ("RLHF_BATCH_LOCK_STALE_S",)  # read as seconds > 0 (store/lock.py)
COUNTS = ("RLHF_BATCH_UPLOADS",)  # read as whole numbers >= 0 (store/fs.py)


def seconds(name: str, default: float) -> float:
    """The environment variable `name` as a number of seconds > 0 (`default` when unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{name}: must be a number of seconds > 0, got {raw!r}")
    return value


def count(name: str, default: int) -> int:
    """The environment variable `name` as a whole number >= 0 (`default` when unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()):  # "²".isdigit(), but int("²") fails
        raise UserError(f"{name}: must be a whole number >= 0, got {raw!r}")
    return int(raw)


def check() -> None:
    """Every numeric variable that is set holds a number."""
    for name in SECONDS:
        seconds(name, 1.0)
    for name in COUNTS:
        count(name, 0)
