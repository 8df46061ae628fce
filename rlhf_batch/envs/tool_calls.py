"""Tool calls in an assistant turn, in the format the model's chat template declares.

Qwen2.5, Qwen3, Hermes and the tiny test model's templates declare the Hermes format: each call
is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`
(vLLM's `hermes` parser, verl's HermesToolParser); a tool result goes back as a message of role
"tool", which such templates render inside `<tool_response>` ... `</tool_response>`. A call that
cannot be read (not JSON, no name, arguments not an object, a tag not closed) is kept as a
`ToolCall` with `error` set, which the environment answers to the model as the tool's result,
as TRL and verl answer a failed call, instead of ending the trajectory.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str
    end: str


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
FORMATS = (HERMES,)


@dataclass(frozen=True)
class ToolCall:
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the call could not be read ("" when it could)


def declared_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template renders assistant tool calls in (None: none known)."""
    for fmt in FORMATS:
        if chat_template and fmt.start in chat_template and fmt.end in chat_template:
            return fmt
    return None


def parse_tool_calls(text: str, fmt: ToolCallFormat = HERMES) -> tuple[str, list[ToolCall]]:
    """The text before the first call, and the calls of an assistant turn (in order)."""
    first = text.find(fmt.start)
    if first < 0:
        return text, []
    calls, pos = [], first
    while (start := text.find(fmt.start, pos)) >= 0:
        body_at = start + len(fmt.start)
        end = text.find(fmt.end, body_at)
        if end < 0:
            calls.append(ToolCall(error=f"{fmt.start} is not closed by {fmt.end}"))
            break
        calls.append(_read_call(text[body_at:end]))
        pos = end + len(fmt.end)
    return text[:first], calls


def _read_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI's wire format carries the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error='"arguments" must be a JSON object')
    return ToolCall(name=obj["name"], arguments=args)
