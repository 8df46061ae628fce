"""OpenAI-style chat messages <-> a trajectory's tokens, through the policy's chat template.

A trajectory is a prompt (the messages before the first assistant message, rendered with the
generation prompt) and a response of segments: each assistant message (the tokens the policy
samples: its content, tool calls as the template renders them, and the template's end-of-turn
token; loss mask 1), and each other message with the template's glue around it (loss mask 0).

Both directions find the messages in the rendered text the same way: the template renders the
same roles with placeholder contents, and the text between placeholders (the glue: role
headers, `<tool_response>` tags, end-of-turn tokens) must appear literally between the
messages. So any template whose glue does not depend on a message's content works, without
knowing its syntax. An assistant message's text is split into content and tool calls in the
Hermes format (envs/tool_calls.py, as the Qwen2.5 template renders them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlhf_batch.envs.tool_calls import HERMES, ToolCallFormat, parse_tool_calls
from rlhf_batch.errors import SchemaError

ROLES = ("system", "user", "assistant", "tool")
PLACEHOLDER = "@@rlhf-batch-message-{}@@"


@dataclass
class Trajectory:
    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    turn_starts: list[int]
    turn_roles: list[str]


def normalize(messages: Any, where: str) -> list[dict[str, Any]]:
    """Check a row's messages (roles, contents, tool calls) and return them as the template
    takes them: tool-call arguments as objects (OpenAI's JSON strings decoded)."""
    if not isinstance(messages, list) or not messages:
        raise SchemaError(f"{where}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}, message {i + 1}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise SchemaError(f"{at}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise SchemaError(f"{at}: content must be a string, not {type(content).__name__}")
        msg: dict[str, Any] = {"role": m["role"], "content": content or ""}
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant":
                raise SchemaError(f"{at}: only assistant messages have tool_calls")
            msg["tool_calls"] = [_call(c, at) for c in calls]
        out.append(msg)
    return out


def drop_null_keys(v: Any) -> Any:
    """A JSON value without the null keys Arrow's struct inference adds (other rows' keys)."""
    if isinstance(v, dict):
        return {k: drop_null_keys(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [drop_null_keys(x) for x in v]
    return v


def _call(c: Any, at: str) -> dict[str, Any]:
    f = c.get("function", c) if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise SchemaError(f'{at}: a tool call is {{"function": {{"name": ..., "arguments": ...}}}}')
    args = f.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise SchemaError(f"{at}: tool call {f['name']!r}: arguments are not JSON") from None
    if not isinstance(args, dict):
        raise SchemaError(f"{at}: tool call {f['name']!r}: arguments must be a JSON object")
    args = {k: v for k, v in args.items() if v is not None}  # keys Arrow's struct inference added
    return {"type": "function", "function": {"name": f["name"], "arguments": args}}


def glue(tok: Any, roles: list[str], tools: list[Any] | None = None) -> list[str]:
    """The template's text before, between and after `roles` messages (len(roles) + 1 pieces)."""
    msgs = [{"role": r, "content": PLACEHOLDER.format(i)} for i, r in enumerate(roles)]
    text = tok.apply_chat_template(msgs, tools=tools or None, tokenize=False)
    pieces, pos = [], 0
    for i in range(len(roles)):
        at = text.find(PLACEHOLDER.format(i), pos)
        if at < 0:
            raise SchemaError(f"the policy's chat template does not render message {i + 1} ({roles[i]})")
        pieces.append(text[pos:at])
        pos = at + len(PLACEHOLDER.format(i))
    return [*pieces, text[pos:]]


def spans(pieces: list[str], text: str) -> list[tuple[int, int]] | None:
    """Where each message's text is in `text` rendered with glue `pieces` (None: no match)."""
    pattern = "".join(re.escape(p) + "(.*?)" for p in pieces[:-1]) + re.escape(pieces[-1])
    m = re.fullmatch(pattern, text, re.DOTALL)
    return None if m is None else [m.span(i + 1) for i in range(len(pieces) - 1)]


def end_of_turn(tok: Any, after_assistant: str) -> str:
    """The special token the glue after an assistant message starts with ("" if none)."""
    specials = sorted(set(tok.all_special_tokens) | set(_added_specials(tok)), key=len, reverse=True)
    return next((s for s in specials if s and after_assistant.startswith(s)), "")


def _added_specials(tok: Any) -> list[str]:
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return [t.content for t in added.values() if getattr(t, "special", False)]


def tokenize(tok: Any, messages: list[dict[str, Any]], tools: list[Any] | None, where: str) -> Trajectory:
    """The prompt and segments of a conversation (module docstring); it ends with an assistant message."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise SchemaError(f"{where}: no assistant message (nothing the policy said to train on)")
    if roles[-1] != "assistant":
        raise SchemaError(
            f"{where}: the last message is {roles[-1]!r}; a trajectory ends with an assistant turn"
        )
    first = roles.index("assistant")
    if first == 0:
        raise SchemaError(f"{where}: the first message is the assistant's; a prompt message comes first")
    pieces = glue(tok, roles, tools)
    text, found, texts = _render(tok, messages, tools, pieces)
    if found is None:
        raise SchemaError(f"{where}: the messages' rendering does not fit the chat template's turns")
    segments: list[tuple[int, int, str]] = []
    cursor = found[first][0]
    for j in range(first, len(roles)):
        start, end = found[j]
        if roles[j] == "assistant":
            eot = end_of_turn(tok, pieces[j + 1])
            end += len(eot) if text.startswith(eot, end) else 0
        elif j + 1 < len(roles) and roles[j + 1] == "assistant":
            end = found[j + 1][0]  # the glue up to the next assistant turn's first token
        segments.append((cursor, end, roles[j]))
        cursor = end
    prompt = text[: found[first][0]]
    t = Trajectory(prompt, encode(tok, text, 0, found[first][0], texts, prompt=True), [], [], [], [])
    for a, b, role in segments:
        ids = encode(tok, text, a, b, texts)
        if not ids:
            raise SchemaError(f"{where}: an empty {role} turn (no tokens)")
        t.turn_starts.append(len(t.response_ids))
        t.turn_roles.append(role)
        t.response_ids += ids
        t.loss_mask += [int(role == "assistant")] * len(ids)
    return t


def _render(
    tok: Any, messages: list[dict[str, Any]], tools: list[Any] | None, pieces: list[str]
) -> tuple[str, list[tuple[int, int]] | None, list[tuple[int, int]]]:
    """The conversation rendered, each message's span in it (its content and, for an assistant
    message, its tool calls as the template renders them; None: the rendering does not fit the
    glue), and where the message contents are. The messages are found in a rendering whose
    contents are placeholders, so a content holding the template's own markers (`<|im_end|>`,
    a role header) cannot be taken for glue. A template that rewrites contents (trims them, say)
    is matched on the real rendering instead, and then no content is known as text."""
    text = tok.apply_chat_template(messages, tools=tools or None, tokenize=False)
    marked = [{**m, "content": PLACEHOLDER.format(i) if m["content"] else ""} for i, m in enumerate(messages)]
    shown = tok.apply_chat_template(marked, tools=tools or None, tokenize=False)
    found = spans(pieces, shown)
    rebuilt, texts, shift, pos = [], [], [], 0  # shift: (placeholder end, offset change after it)
    for i, m in enumerate(messages):
        at = shown.find(PLACEHOLDER.format(i), pos) if m["content"] else -1
        if at < 0:
            continue
        rebuilt.append(shown[pos:at])
        start = sum(map(len, rebuilt))
        rebuilt.append(m["content"])
        texts.append((start, start + len(m["content"])))
        pos = at + len(PLACEHOLDER.format(i))
        shift.append((pos, len(m["content"]) - len(PLACEHOLDER.format(i))))
    if found is None or "".join(rebuilt) + shown[pos:] != text:
        return text, spans(pieces, text), []

    def real(k: int) -> int:  # an offset of `shown` (never inside a placeholder) in `text`
        return k + sum(d for end, d in shift if end <= k)

    return text, [(real(a), real(b)) for a, b in found], texts


def encode(
    tok: Any, text: str, a: int, b: int, texts: list[tuple[int, int]], prompt: bool = False
) -> list[int]:
    """The tokens of text[a:b]: the template's markup as the tokenizer reads it (special tokens
    recognised), the message contents in `texts` (spans of `text`) as plain text, a special
    token's name in them split into ordinary tokens. Where no content holds a special token's
    name this is tok(text[a:b]) exactly (`prompt`: with the tokens the tokenizer adds in front,
    as a prompt has always been tokenised)."""
    inside = [(max(s, a), min(e, b)) for s, e in texts if max(s, a) < min(e, b)]
    names = _special_names(tok)
    if not any(n in text[s:e] for s, e in inside for n in names):
        return list(tok(text[a:b], add_special_tokens=prompt)["input_ids"])
    ids: list[int] = list(tok("", add_special_tokens=True)["input_ids"]) if prompt else []
    cursor = a
    for s, e in [*inside, (b, b)]:
        base = cursor
        for m in re.finditer("|".join(map(re.escape, names)), text[base:s]):  # specials of the markup
            ids += _plain(tok, text[cursor : base + m.start()])
            ids.append(int(tok.convert_tokens_to_ids(m.group())))
            cursor = base + m.end()
        ids += _plain(tok, text[cursor:e])  # the markup's tail and the content, one run
        cursor = e
    return ids


def _plain(tok: Any, text: str) -> list[int]:
    """`text` tokenised with every special token's name as ordinary text."""
    if not text:
        return []
    return list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _special_names(tok: Any) -> list[str]:
    return sorted({*tok.all_special_tokens, *_added_specials(tok)} - {""}, key=len, reverse=True)


def segment_texts(tok: Any, response_ids: list[int], starts: list[int]) -> list[str]:
    """The text of each segment of a multi-turn response (its tokens decoded, special tokens kept)."""
    ends = [*starts[1:], len(response_ids)]
    return [_decode(tok, response_ids[s:e]) for s, e in zip(starts, ends, strict=True)]


def assistant_message(text: str, specials: list[str], fmt: ToolCallFormat = HERMES) -> dict[str, Any]:
    """An assistant turn's text as a message: content and tool calls in format `fmt` (arguments
    as OpenAI's JSON strings); trailing special tokens (end of turn, EOS) dropped."""
    while any(s and text.endswith(s) for s in specials):
        text = text[: -len(next(s for s in specials if s and text.endswith(s)))]
    content, calls = parse_tool_calls(text, fmt)
    if not calls or any(c.error for c in calls):
        return {"role": "assistant", "content": text, "tool_calls": None}
    tool_calls = [
        {
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": content.removesuffix("\n"), "tool_calls": tool_calls}


def response_messages(
    tok: Any,
    prompt_roles: list[str],
    response_ids: list[int],
    turn_starts: list[int],
    turn_roles: list[str],
    where: str,
    fmt: ToolCallFormat = HERMES,
) -> list[dict[str, Any]]:
    """The messages of a multi-turn response, one per segment, each read from its own tokens (so
    a message's text holding the template's markers stays in its message): an assistant
    segment without its trailing special tokens (end of turn, EOS), any other with the
    template's glue around its content taken off."""
    if len(turn_starts) != len(turn_roles) or turn_starts[:1] != [0]:
        raise SchemaError(f"{where}: 'turn_starts' and 'turn_roles' do not describe the response's segments")
    pieces = glue(tok, [*prompt_roles, *turn_roles])[len(prompt_roles) :]  # pieces[k]: before segment k
    special = {int(i) for i in tok.convert_tokens_to_ids(_special_names(tok))}
    ends = [*turn_starts[1:], len(response_ids)]
    out = []
    for k, (role, s, e) in enumerate(zip(turn_roles, turn_starts, ends, strict=True)):
        ids = response_ids[s:e]
        if role == "assistant":
            while ids and ids[-1] in special:
                ids = ids[:-1]
            out.append(assistant_message(_decode(tok, ids), [], fmt))
            continue
        text = _decode(tok, ids)
        before = pieces[k]
        if not text.startswith(before) and k and turn_roles[k - 1] == "assistant":
            before = before[len(end_of_turn(tok, before)) :]  # the assistant's segment holds its end of turn
        after = pieces[k + 1] if turn_roles[k + 1 : k + 2] == ["assistant"] else ""
        if not (text.startswith(before) and text.endswith(after) and len(text) >= len(before) + len(after)):
            raise SchemaError(
                f"{where}: segment {k + 1} ({role}) does not fit the chat template's turns "
                f"({', '.join(turn_roles)})"
            )
        out.append({"role": role, "content": text[len(before) : len(text) - len(after)], "tool_calls": None})
    return out


def _decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def completion_messages(tok: Any, row: dict[str, Any], fmt: ToolCallFormat = HERMES) -> list[dict[str, Any]]:
    """A rollout's response as the messages a reward function reads (`completion_messages`,
    TRL's conversational `completions`): each assistant turn `{"role": "assistant", "content"}`
    with its `tool_calls` (`{"type": "function", "function": {"name", "arguments": {...}}}`)
    when it made calls, each environment message `{"role": "tool" or "user", "content"}` (a tool
    message answering call k of the turn before also has that call's `name`). `row`: the
    rollouts row (`response`, `response_ids`, `turn_starts`, `turn_roles`, `prompt_messages`).
    A single-turn row is one assistant message of its `response`. When the chat template does
    not render the response's turns (no template, another one), each segment's text is its
    message's content (template glue and all), assistant turns still split into content and calls."""
    roles = row.get("turn_roles")
    if not roles:
        return [{"role": "assistant", "content": row["response"]}]
    prompt_roles = [m["role"] for m in row.get("prompt_messages") or []] or ["user"]
    try:
        msgs = response_messages(tok, prompt_roles, row["response_ids"], row["turn_starts"], roles, "", fmt)
    except Exception:  # noqa: BLE001 - any template failure: the segments' own texts
        ids, bounds = row["response_ids"], [*row["turn_starts"], len(row["response_ids"])]
        segs = [
            tok.decode(ids[a:b], skip_special_tokens=True) for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        msgs = [
            assistant_message(t, [], fmt)
            if r == "assistant"
            else {"role": r, "content": t, "tool_calls": None}
            for r, t in zip(roles, segs, strict=True)
        ]
    out, calls = [], []
    for m in msgs:
        msg: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m["role"] == "assistant":
            calls = [c["function"] for c in m.get("tool_calls") or []]
            if calls:
                msg["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.loads(c["arguments"])},
                    }
                    for c in calls
                ]
        elif m["role"] == "tool" and calls:
            msg["name"] = calls.pop(0)["name"]
        out.append(msg)
    return out
