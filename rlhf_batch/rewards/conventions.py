"""Calling conventions of reward functions: ours, TRL's and verl's, selected by a prefix.

``"package.module:fn"`` (no prefix): one call per batch with keyword lists ``prompts``,
``responses``, ``prompt_ids``, ``response_ids`` and every carried column (see `rlhf_batch.rewards`).

``"trl:package.module:fn"``: as TRL's GRPOTrainer calls a reward function, one call per batch::

    fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

For chat prompts (`prompt_messages` in the rollouts) ``prompts`` are the message lists and each
completion is ``[{"role": "assistant", "content": response}]`` (prefixed with the prompt's last
message when that is an assistant turn, as TRL does); for text prompts both are strings. A
multi-turn rollout's completion is its messages (`completion_messages`: assistant turns with
their ``tool_calls``, tool results as ``{"role": "tool", "name", "content"}``), as TRL's tool
loop gives them.

``"verl:package.module:compute_score"``: as verl's reward manager calls ``compute_score``, once
per rollout::

    fn(data_source=..., solution_str=response, ground_truth=..., extra_info=...) -> float | dict

from the `data_source`, `ground_truth` (or verl's `reward_model.ground_truth`) and
`extra_info` columns (None when absent). A dict's ``score`` is the reward; its other keys
become columns ``reward_<fn>_<key>``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from numbers import Real
from typing import Any

import pyarrow as pa

from rlhf_batch.data.prompts import MESSAGES
from rlhf_batch.errors import ConfigError, RewardError
from rlhf_batch.rewards import RewardFunction, call_batched, call_reward_function, check_values


def evaluate(
    rf: RewardFunction, rollout_ids: Sequence[str], **batch: Any
) -> tuple[list[float | None], dict[str, pa.Array]]:
    """The values of `rf` on a batch and the extra columns it gives (verl's dict results).
    `batch`: call_reward_function's keyword arguments (prompts, responses, prompt_ids,
    response_ids, columns)."""
    values, more = evaluate_rows(rf, rollout_ids, **batch)
    return values, extra_columns(rf, more)


def evaluate_rows(
    rf: RewardFunction, rollout_ids: Sequence[str], **batch: Any
) -> tuple[list[float | None], list[Extras] | None]:
    """evaluate's values, and the extra values per row as `Extras` (None: the convention gives
    none), which `extra_columns` turns into columns over a whole batch."""
    prompts, responses, columns = batch["prompts"], batch["responses"], batch["columns"]
    if rf.convention == "trl":
        msgs = batch.get("completion_messages")
        return trl_call(rf, rollout_ids, prompts, responses, batch["response_ids"], columns, msgs), None
    if rf.convention == "verl":
        return verl_rows(rf, rollout_ids, responses, columns)
    return call_reward_function(rf, rollout_ids, **batch), None


def trl_call(
    rf: RewardFunction,
    rollout_ids: Sequence[str],
    prompts: list[str],
    responses: list[str],
    response_ids: list[list[int]],
    columns: dict[str, list[Any]],
    completion_messages: list[list[dict[str, Any]]] | None = None,
) -> list[float | None]:
    messages = columns.get(MESSAGES)
    kwargs: dict[str, Any] = {k: v for k, v in columns.items() if k != MESSAGES}
    turns = columns.get("turn_roles") or [None] * len(responses)
    if messages is None:
        kwargs.update(prompts=prompts, completions=responses)
    else:
        completions = []
        for msgs, response in zip(messages, responses, strict=True):
            boot = msgs[-1]["content"] if msgs and msgs[-1].get("role") == "assistant" else ""
            completions.append([{"role": "assistant", "content": boot + response}])
        kwargs.update(prompts=messages, completions=completions)
    if completion_messages is not None and any(turns):  # a trajectory: its messages, as TRL's tool loop
        kwargs["completions"] = [
            m if r else c for m, r, c in zip(completion_messages, turns, kwargs["completions"], strict=True)
        ]
    kwargs["completion_ids"] = response_ids
    return call_batched(rf, rollout_ids, kwargs)


# One row's extra values (a verl dict result's keys other than `score`), in the order it gave
# them: key -> Cell, None for a None value. A Cell is what `_column` needs of a value, as JSON:
# [kind, number, text] with kind "b" (bool), "f" (a number) or "t" (anything else), `number` the
# value as a float (bools: 0.0 / 1.0; None for "t") and `text` its text form in a text column.
Cell = list[Any]
Extras = dict[str, Cell | None]


def verl_call(
    rf: RewardFunction, rollout_ids: Sequence[str], responses: list[str], columns: dict[str, list[Any]]
) -> tuple[list[float | None], dict[str, pa.Array]]:
    values, more = verl_rows(rf, rollout_ids, responses, columns)
    return values, extra_columns(rf, more)


def verl_rows(
    rf: RewardFunction, rollout_ids: Sequence[str], responses: list[str], columns: dict[str, list[Any]]
) -> tuple[list[float | None], list[Extras]]:
    n = len(rollout_ids)
    none: list[Any] = [None] * n
    source, truth, extra = (columns.get(c, none) for c in ("data_source", "ground_truth", "extra_info"))
    values: list[Any] = []
    more: list[Extras] = []
    for i, rid in enumerate(rollout_ids):
        try:
            out = rf.fn(
                data_source=source[i], solution_str=responses[i], ground_truth=truth[i], extra_info=extra[i]
            )
        except Exception as e:  # noqa: BLE001 - a user function: report it with the rollout
            msg = str(e).splitlines()[0] if str(e) else ""
            raise RewardError(
                f"reward function {rf.path} raised {type(e).__name__}: {msg} (rollout {rid})"
            ) from e
        row: Extras = {}
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(
                    f"reward function {rf.path} returned a dict without 'score' for rollout {rid} "
                    f"(keys: {', '.join(map(str, out))})"
                )
            row = {str(k): cell(v) for k, v in out.items() if k != "score"}
            out = out["score"]
        values.append(out)
        more.append(row)
    return check_values(rf, rollout_ids, values), more


def cell(v: Any) -> Cell | None:
    """What `extra_columns` needs of one extra value (see Cell); None for None."""
    if v is None:
        return None
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    if isinstance(v, bool):
        return ["b", float(v), text]
    if isinstance(v, Real):
        return ["f", float(v), text]
    return ["t", None, text]


def extra_columns(rf: RewardFunction, rows: list[Extras] | None) -> dict[str, pa.Array]:
    """Columns ``reward_<fn>_<key>`` of the rows' extra values, in the order the keys first
    appear (a row without a key: null there)."""
    if rows is None:
        return {}
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {f"{rf.column}_{k}": _column([row.get(k) for row in rows]) for k in keys}


def _column(cells: list[Cell | None]) -> pa.Array:
    """bool when every value is a bool, float64 when every value is a number, else text (JSON
    for anything that is not a string); None stays null. All-null is float64."""
    present = [c for c in cells if c is not None]
    if present and all(c[0] == "b" for c in present):
        return pa.array([None if c is None else bool(c[1]) for c in cells], pa.bool_())
    if all(c[0] == "f" for c in present):
        return pa.array([None if c is None else c[1] for c in cells], pa.float64())
    return pa.array([None if c is None else c[2] for c in cells], pa.string())


PASSED = {  # the keyword arguments each convention passes besides the data's columns
    "": ("prompts", "responses", "prompt_ids", "response_ids"),  # and completion_messages, when taken
    "trl": ("prompts", "completions", "completion_ids"),
    "verl": ("solution_str",),
}
VERL_FIELDS = ("data_source", "ground_truth", "extra_info")  # from columns of these names


def argument_problem(rf: RewardFunction, columns: Sequence[str]) -> str | None:
    """Why calling `rf` on rows with the carried `columns` would fail or get None for an argument
    it requires (one line naming the function, the argument and the columns), or None."""
    import inspect

    try:
        params = inspect.signature(rf.fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {n for n, p in params.items() if p.kind in kinds}
    required = [n for n, p in params.items() if p.kind in kinds and p.default is inspect.Parameter.empty]
    if rf.convention == "verl":
        given = {*PASSED["verl"], *(f for f in VERL_FIELDS if f in columns)}
        passed = {*PASSED["verl"], *VERL_FIELDS}
    else:
        given = passed = {*PASSED[rf.convention], *(c for c in columns if c != MESSAGES or not rf.convention)}
        given = given | ({"completion_messages"} if not rf.convention else set())
    have = ", ".join(c for c in columns if c != MESSAGES) or "none"
    if missing := [n for n in required if n not in given]:
        what = "verl field" if rf.convention == "verl" else "argument"
        return (
            f"reward function {rf.path} needs {what} {', '.join(repr(m) for m in missing)}, which no column "
            f"of the prompt data gives (columns: {have})"
        )
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not takes_kwargs and (extra := sorted(passed - named)):
        return (
            f"reward function {rf.path} does not take argument {', '.join(repr(e) for e in extra)}, which "
            "score passes; add **kwargs to its parameters"
        )
    return None


def check_arguments(fns: Sequence[RewardFunction], columns: Sequence[str], where: str) -> None:
    """ConfigError at the first reward function with an argument_problem (before any scoring)."""
    for rf in fns:
        if (problem := argument_problem(rf, columns)) is not None:
            raise ConfigError(f"{where}: {problem}")
