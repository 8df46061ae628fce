"""Calling conventions of reward functions: ours, TRL's and verl's, selected by a prefix.

``"package.module:fn"`` (no prefix): one call per batch with keyword lists ``prompts``,
``responses``, ``prompt_ids``, ``response_ids`` and every carried column (see `rlhf_batch.rewards`).

``"trl:package.module:fn"``: as TRL's GRPOTrainer calls a reward function, one call per batch::

    fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

For chat prompts (`prompt_messages` in the rollouts) ``prompts`` are the message lists and each
completion is ``[{"role": "assistant", "content": response}]`` (prefixed with the prompt's last
message when that is an assistant turn, as TRL does); for text prompts both are strings.

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
from rlhf_batch.errors import RewardError
from rlhf_batch.rewards import RewardFunction, call_batched, call_reward_function, check_values


def evaluate(
    rf: RewardFunction, rollout_ids: Sequence[str], **batch: Any
) -> tuple[list[float | None], dict[str, pa.Array]]:
    """The values of `rf` on a batch and the extra columns it gives (verl's dict results).
    `batch`: call_reward_function's keyword arguments (prompts, responses, prompt_ids,
    response_ids, columns)."""
    prompts, responses, columns = batch["prompts"], batch["responses"], batch["columns"]
    if rf.convention == "trl":
        return trl_call(rf, rollout_ids, prompts, responses, batch["response_ids"], columns), {}
    if rf.convention == "verl":
        return verl_call(rf, rollout_ids, responses, columns)
    return call_reward_function(rf, rollout_ids, **batch), {}


def trl_call(
    rf: RewardFunction,
    rollout_ids: Sequence[str],
    prompts: list[str],
    responses: list[str],
    response_ids: list[list[int]],
    columns: dict[str, list[Any]],
) -> list[float | None]:
    messages = columns.get(MESSAGES)
    kwargs: dict[str, Any] = {k: v for k, v in columns.items() if k != MESSAGES}
    if messages is None:
        kwargs.update(prompts=prompts, completions=responses)
    else:
        completions = []
        for msgs, response in zip(messages, responses, strict=True):
            boot = msgs[-1]["content"] if msgs and msgs[-1].get("role") == "assistant" else ""
            completions.append([{"role": "assistant", "content": boot + response}])
        kwargs.update(prompts=messages, completions=completions)
    kwargs["completion_ids"] = response_ids
    return call_batched(rf, rollout_ids, kwargs)


def verl_call(
    rf: RewardFunction, rollout_ids: Sequence[str], responses: list[str], columns: dict[str, list[Any]]
) -> tuple[list[float | None], dict[str, pa.Array]]:
    n = len(rollout_ids)
    none: list[Any] = [None] * n
    source, truth, extra = (columns.get(c, none) for c in ("data_source", "ground_truth", "extra_info"))
    values: list[Any] = []
    more: dict[str, list[Any]] = {}
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
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(
                    f"reward function {rf.path} returned a dict without 'score' for rollout {rid} "
                    f"(keys: {', '.join(map(str, out))})"
                )
            for key, value in out.items():
                if key != "score":
                    more.setdefault(str(key), [None] * n)[i] = value
            out = out["score"]
        values.append(out)
    extras = {f"{rf.column}_{k}": _column(v) for k, v in more.items()}
    return check_values(rf, rollout_ids, values), extras


def _column(values: list[Any]) -> pa.Array:
    """bool when every value is a bool, float64 when every value is a number, else text (JSON
    for anything that is not a string); None stays null. All-null is float64."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.array(values, pa.bool_())
    if all(isinstance(v, Real) and not isinstance(v, bool) for v in present):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    text = [None if v is None else v if isinstance(v, str) else json.dumps(v, default=str) for v in values]
    return pa.array(text, pa.string())
