"""Which objective trains each iteration (`train.objective`): pure, no I/O.

The value is one objective for every iteration (``"grpo"``, ``"sft"``, ``"dpo"``) or a list of
``"name:N"`` entries (N iterations each, in order) whose last entry may be a bare ``"name"``: it
then holds for every iteration after the others. When every entry has a count the list repeats,
so ``["sft:1", "grpo:3"]`` alternates one SFT iteration with three GRPO ones.

>>> objective_at(parse_schedule(["sft:2", "grpo"]), 1), objective_at(parse_schedule(["sft:2", "grpo"]), 7)
('sft', 'grpo')
>>> [objective_at(parse_schedule(["sft:1", "grpo:2"]), k) for k in range(5)]
['sft', 'grpo', 'grpo', 'sft', 'grpo']
"""

from __future__ import annotations

OBJECTIVES = ("grpo", "sft", "dpo")
Schedule = list[tuple[str, int]]  # (objective, iterations); 0 iterations: every later one


def parse_schedule(value: str | list[str]) -> Schedule:
    """The entries of `value`; ValueError saying what is wrong."""
    entries = [value] if isinstance(value, str) else list(value)
    if not entries:
        raise ValueError("must name an objective (grpo, sft, dpo) or list 'name:N' entries")
    out: Schedule = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise ValueError(f"entry {entry!r} is not a string 'name' or 'name:N'")
        name, colon, count = entry.partition(":")
        if name not in OBJECTIVES:
            raise ValueError(f"entry {entry!r}: the objective must be one of {', '.join(OBJECTIVES)}")
        if not colon:
            if i != len(entries) - 1:
                raise ValueError(
                    f"entry {entry!r} has no iteration count: only the last entry may (the rest)"
                )
            out.append((name, 0))
            continue
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"entry {entry!r}: N in 'name:N' must be a whole number >= 1")
        out.append((name, int(count)))
    return out


def objective_at(schedule: Schedule, iteration: int) -> str:
    """The objective of `iteration` (>= 0) under `schedule`."""
    if schedule[-1][1] == 0:  # the last entry holds for the rest
        k = iteration
        for name, n in schedule[:-1]:
            if k < n:
                return name
            k -= n
        return schedule[-1][0]
    k = iteration % sum(n for _, n in schedule)  # every entry counted: the list repeats
    for name, n in schedule:
        if k < n:
            return name
        k -= n
    raise AssertionError("unreachable")


def uses(schedule: Schedule, objective: str) -> bool:
    """Whether some iteration trains with `objective`."""
    return any(name == objective for name, _ in schedule)
