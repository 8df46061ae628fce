"""`import` of trajectories as OpenAI-style chat messages (a `messages` column).

Each row's `messages` (roles system, user, assistant, tool; assistant `tool_calls` with
`function.name` and `function.arguments`, an object or a JSON string) is one trajectory: the
messages before the first assistant message are the prompt, the rest the response, which ends
with an assistant message. An optional `tools` column (tool schemas or built-in tool names,
`tool_list`) goes to the chat template as `apply_chat_template(tools=...)`.

* Messages only: tokenised with the policy's chat template (data/chat_turns.py): each assistant
  message is a segment of loss mask 1 (its end-of-turn token included), every other message,
  with the template's glue, a segment of loss mask 0; behaviour log-probs are recomputed with
  the policy (as for a (prompt, response) row) and are 0.0 where the mask is 0;
  `behavior_recomputed` is true.
* With `token_ids` and `loss_mask` (the whole conversation's tokens, prompt included, and 1 on
  the tokens the policy sampled): the prompt is the first P tokens, P the length of the
  prompt messages rendered with the generation prompt; the mask must be 0 there, and its runs
  of ones must be as many as the assistant messages after the prompt. Each run of zeros is one
  segment (role: its first message's). With `behavior_logprobs` too (one per token of
  `token_ids`), they are kept where the mask is 1 (0.0 elsewhere) and `behavior_recomputed` is
  false.

Rollouts gain `prompt_messages`, `loss_mask`, `turn_starts`, `turn_roles`, `turn_texts` (the
multi-turn rollout contract) and `behavior_recomputed`; `prompt` is the rendered prompt and `response` the
response's text (special tokens dropped). A row without a prompt_id gets the hash of its
prompt messages (JSON).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rlhf_batch.config import Config
from rlhf_batch.data import chat_turns
from rlhf_batch.errors import SchemaError
from rlhf_batch.models.forward import batched_logprobs
from rlhf_batch.stages.import_rows import (
    COMPUTED,
    add_ids,
    check_given_ids,
    check_given_logprobs,
    check_positions,
    no_nulls,
    positions_of,
)
from rlhf_batch.store import layout
from rlhf_batch.store.schemas import LOGPROBS, TOKENS

MESSAGES = "messages"
GIVEN = ("token_ids", "loss_mask", "behavior_logprobs")
MASK, STARTS, ROLES = pa.list_(pa.int8()), pa.list_(pa.int32()), pa.list_(pa.string())
PROMPT_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
DROPPED = (MESSAGES, *GIVEN)  # read here, not carried into the rollouts
ADDED = ("prompt_messages", "turn_starts", "turn_roles", "turn_texts", "behavior_recomputed")


def prepare(t: pa.Table, path: Path, iteration: int) -> pa.Table:
    """Check the columns and every row's messages; add the ids (import_rows.add_ids)."""
    for name in ("prompt", "response", "response_ids", *COMPUTED, *ADDED):
        if name in t.column_names:
            raise SchemaError(f"{path}: column '{name}' is computed from 'messages'; drop it")
    typ = t.schema.field(MESSAGES).type
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not pa.types.is_struct(typ.value_type):
        raise SchemaError(f"{path}: column 'messages' has type {typ}, expected a list of {{role, content}}")
    no_nulls(t[MESSAGES], path, MESSAGES)
    if ("token_ids" in t.column_names) != ("loss_mask" in t.column_names):
        raise SchemaError(f"{path}: columns 'token_ids' and 'loss_mask' come together")
    if "behavior_logprobs" in t.column_names and "token_ids" not in t.column_names:
        raise SchemaError(f"{path}: column 'behavior_logprobs' needs the 'token_ids' it scores")
    for name in GIVEN:
        if name in t.column_names:
            typ = t.schema.field(name).type
            test = pa.types.is_floating if name == "behavior_logprobs" else pa.types.is_integer
            if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not test(typ.value_type):
                raise SchemaError(f"{path}: column '{name}' has type {typ}, expected a list of numbers")
            no_nulls(t[name], path, name)
    keys = []
    for row, msgs in enumerate(t[MESSAGES].to_pylist()):
        norm = chat_turns.normalize(msgs, f"{path}: row {row + 1}, column 'messages'")
        first = next((i for i, m in enumerate(norm) if m["role"] == "assistant"), len(norm))
        keys.append(json.dumps(norm[:first], sort_keys=True))
    _tools(t, path, 0)  # every row's tools read
    return add_ids(t, keys, path, iteration)


def _tools(t: pa.Table, path: Path, offset: int) -> list[Any]:
    """Each row's tools for the chat template: schemas as given, names of built-in tools as
    their schemas (`tool_list`)."""
    if "tools" not in t.column_names:
        return [None] * t.num_rows
    return [
        tool_list(v, f"{path}: row {offset + i + 1}, column 'tools'")
        for i, v in enumerate(t["tools"].to_pylist())
    ]


def tool_list(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A `tools` value as tool schemas: a list of OpenAI function schemas or of built-in tool
    names (envs/tools.py), either as JSON, one comma-separated string of names, or one schema."""
    from rlhf_batch.envs.tools import BUILTIN, tool_schemas

    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [n.strip() for n in value.split(",") if n.strip()]
    if isinstance(value, str | dict):
        value = [value]
    if not isinstance(value, list):
        raise SchemaError(f"{where}: expected a list of tool schemas or tool names")
    out = []
    for k, tool in enumerate(value):
        if isinstance(tool, str) and tool in BUILTIN:
            out.extend(tool_schemas([tool]))
        elif isinstance(tool, str):
            raise SchemaError(
                f"{where}: unknown tool {tool!r} (built-in: {', '.join(BUILTIN)}; else give its schema)"
            )
        elif isinstance(tool, dict):
            out.append(chat_turns.drop_null_keys(tool))
        else:
            raise SchemaError(f"{where}: tool {k + 1} is neither a schema (an object) nor a name")
    return out


def tokenize_part(
    t: pa.Table, tok: Any, model: Any, cfg: Config, policy: str, path: Path, offset: int
) -> tuple[pa.Table, dict[str, int]]:
    """One part's trajectories (rows `offset`+1 ... of the file) as multi-turn rollouts."""
    tools = _tools(t, path, offset)
    trajs = []
    for i, (msgs, tl) in enumerate(zip(t[MESSAGES].to_pylist(), tools, strict=True)):
        where = f"{path}: row {offset + i + 1}"
        norm = chat_turns.normalize(msgs, f"{where}, column 'messages'")
        traj = chat_turns.tokenize(tok, norm, tl, f"{where}, column 'messages'")
        if "token_ids" in t.column_names:
            traj = _given(traj, norm, t, i, where)
        trajs.append(traj)
    rid = t["rollout_id"].to_pylist()
    check_given_ids([x.response_ids for x in trajs], rid, int(model.config.vocab_size), str(path))
    check_positions(
        [x.prompt_ids for x in trajs], [x.response_ids for x in trajs], rid, positions_of(model), str(path)
    )
    logps = _logprobs(t, trajs, model, tok, cfg, path, offset)
    out = t.drop_columns([c for c in DROPPED if c in t.column_names])
    prompts = [
        [{"role": m["role"], "content": m["content"]} for m in _prompt_of(x)] for x in t[MESSAGES].to_pylist()
    ]
    columns: dict[str, tuple[list[Any], pa.DataType]] = {
        "prompt": ([x.prompt for x in trajs], pa.string()),
        "prompt_ids": ([x.prompt_ids for x in trajs], TOKENS),
        "response": ([tok.decode(x.response_ids, skip_special_tokens=True) for x in trajs], pa.string()),
        "response_ids": ([x.response_ids for x in trajs], TOKENS),
        "behavior_logprobs": ([lp.tolist() for lp in logps], LOGPROBS),
        "policy": ([layout.in_run(policy, cfg.run_dir)] * len(trajs), pa.string()),
        "prompt_messages": (prompts, PROMPT_MESSAGES),
        "loss_mask": ([x.loss_mask for x in trajs], MASK),
        "turn_starts": ([x.turn_starts for x in trajs], STARTS),
        "turn_roles": ([x.turn_roles for x in trajs], ROLES),
        "turn_texts": ([chat_turns.segment_texts(tok, x.response_ids, x.turn_starts) for x in trajs], ROLES),
        "behavior_recomputed": ([("behavior_logprobs" not in t.column_names)] * len(trajs), pa.bool_()),
    }
    for name, (values, typ) in columns.items():
        out = out.append_column(name, pa.array(values, typ))
    sampled = sum(sum(x.loss_mask) for x in trajs)
    counts = {
        "rows": len(trajs),
        "tokens": sum(len(x.response_ids) for x in trajs),
        "sampled_tokens": sampled,
    }
    return out, counts


def _prompt_of(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    first = next(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
    return [{"role": m["role"], "content": m.get("content") or ""} for m in msgs[:first]]


def _given(
    traj: chat_turns.Trajectory, msgs: list[dict[str, Any]], t: pa.Table, i: int, where: str
) -> chat_turns.Trajectory:
    """The row's own tokens and mask, split into the template's prompt and segments."""
    ids, mask = t["token_ids"][i].as_py(), t["loss_mask"][i].as_py()
    if len(mask) != len(ids):
        raise SchemaError(f"{where}: column 'loss_mask' has {len(mask)} values for {len(ids)} token_ids")
    if any(v not in (0, 1) for v in mask):
        raise SchemaError(
            f"{where}: column 'loss_mask' holds {next(v for v in mask if v not in (0, 1))}; expected 0 or 1"
        )
    p = len(traj.prompt_ids)
    if 1 in mask[:p]:
        raise SchemaError(
            f"{where}: column 'loss_mask' is 1 on prompt token {mask.index(1) + 1} (the prompt messages are "
            f"{p} tokens)"
        )
    resp = mask[p:]
    if not resp or resp[0] != 1 or resp[-1] != 1:
        raise SchemaError(
            f"{where}: column 'loss_mask': the response (after the prompt's {p} tokens) must start and end "
            "with sampled tokens (1)"
        )
    starts = [k for k in range(len(resp)) if k == 0 or resp[k] != resp[k - 1]]
    assistants = traj.turn_roles.count("assistant")
    if sum(resp[k] for k in starts) != assistants:
        raise SchemaError(
            f"{where}: column 'loss_mask' has {sum(resp[k] for k in starts)} runs of sampled tokens for "
            f"{assistants} assistant messages"
        )
    gaps = iter(
        r
        for r, prev in zip(traj.turn_roles, [None, *traj.turn_roles], strict=False)
        if r != "assistant" and prev == "assistant"
    )
    roles = ["assistant" if resp[k] else next(gaps) for k in starts]
    return chat_turns.Trajectory(traj.prompt, ids[:p], ids[p:], resp, starts, roles)


def _logprobs(
    t: pa.Table,
    trajs: list[chat_turns.Trajectory],
    model: Any,
    tok: Any,
    cfg: Config,
    path: Path,
    offset: int,
) -> list[np.ndarray]:
    """Behaviour log-probs of the response tokens, 0.0 where the loss mask is 0."""
    if "behavior_logprobs" in t.column_names:
        full = t["behavior_logprobs"].to_pylist()
        logps = []
        for i, (x, lp) in enumerate(zip(trajs, full, strict=True)):
            if len(lp) != len(x.prompt_ids) + len(x.response_ids):
                raise SchemaError(
                    f"{path}: row {offset + i + 1}: column 'behavior_logprobs' has {len(lp)} values for "
                    f"{len(x.prompt_ids) + len(x.response_ids)} token_ids"
                )
            logps.append(np.asarray(lp[len(x.prompt_ids) :], np.float64))
        sampled = [lp[np.asarray(x.loss_mask, bool)] for lp, x in zip(logps, trajs, strict=True)]
        check_given_logprobs(sampled, [list(s) for s in sampled], t["rollout_id"].to_pylist(), str(path))
    else:
        logps = batched_logprobs(
            model,
            [x.prompt_ids for x in trajs],
            [x.response_ids for x in trajs],
            cfg.generate.temperature,
            pad_id=int(tok.pad_token_id),
            max_tokens=cfg.score.max_tokens_per_batch,
        )
    return [np.where(np.asarray(x.loss_mask, bool), lp, 0.0) for lp, x in zip(logps, trajs, strict=True)]
