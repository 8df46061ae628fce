"""Tool calls in an assistant turn, in the format of the model's chat template
(`generate.tool_parser`: "hermes", "llama3_json" or "mistral", the names vLLM's parsers have).

* hermes (Qwen2.5, Qwen3, Hermes and the tiny test model's templates): each call is a JSON
  object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` (vLLM's
  `hermes` parser, verl's HermesToolParser); the text before the first call is the content.
* llama3_json (Llama 3.1 / 3.2 / 3.3 templates): the turn is the calls themselves, JSON objects
  `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after `<|python_tag|>`,
  several separated by `;` (vLLM's `llama3_json`); a turn that does not start with `{` or
  `<|python_tag|>` holds no call.
* mistral (Mistral-7B-Instruct-v0.3 and later templates): `[TOOL_CALLS]` then a JSON list of
  `{"name": ..., "arguments": {...}}` (or, in the newer tokenizers' form, `name[ARGS]{...}` or
  `name{...}` per call); the text before `[TOOL_CALLS]` is the content (vLLM's `mistral`).

A tool result goes back as a message of role "tool", one per call. A call that cannot be read
(not JSON, no name, arguments not an object, a tag not closed) is kept as a `ToolCall` with
`error` set, which the environment answers to the model as the tool's result, as TRL and verl
answer a failed call, instead of ending the trajectory. A call without arguments has `{}`.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # the marker a call (hermes) or the calls (llama3_json, mistral) start with
    end: str = ""  # the marker a hermes call ends with


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3_JSON = ToolCallFormat("llama3_json", "<|python_tag|>")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
_configured = HERMES  # the worker's generate.tool_parser (use_format)


@dataclass(frozen=True)
class ToolCall:
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why the call could not be read ("" when it could)


def tool_format(name: str) -> ToolCallFormat:
    """The format `generate.tool_parser` names."""
    if name not in FORMATS:
        raise ValueError(f"generate.tool_parser: unknown format {name!r} (formats: {', '.join(FORMATS)})")
    return FORMATS[name]


def use_format(name: str) -> None:
    """Make `name` the format a `ToolEnvironment` reads by default (in an environment worker)."""
    global _configured
    _configured = tool_format(name)


def configured_format() -> ToolCallFormat:
    return _configured


def declared_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template renders assistant tool calls in (None: none known)."""
    t = chat_template or ""
    if HERMES.start in t and HERMES.end in t:
        return HERMES
    if MISTRAL.start in t:
        return MISTRAL
    if LLAMA3_JSON.start in t or '"parameters": ' in t:
        return LLAMA3_JSON
    return None


def parse_tool_calls(text: str, fmt: ToolCallFormat = HERMES) -> tuple[str, list[ToolCall]]:
    """The content (the text before the calls) and the calls of an assistant turn, in order."""
    if fmt is LLAMA3_JSON:
        return _llama3(text)
    if fmt is MISTRAL:
        return _mistral(text)
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


def _llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    body = body.removeprefix(LLAMA3_JSON.start).lstrip() if body.startswith(LLAMA3_JSON.start) else body
    if not body.startswith("{"):
        return text, []
    return "", _json_objects(body, ";")


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    first = text.find(MISTRAL.start)
    if first < 0:
        return text, []
    rest = text[first:]
    calls: list[ToolCall] = []
    for chunk in rest.split(MISTRAL.start)[1:]:
        body = chunk.strip()
        if body.startswith("["):  # a JSON list of calls
            try:
                items, _ = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError as e:
                calls.append(
                    ToolCall(error=f"the tool calls are not valid JSON ({e.msg} at character {e.pos})")
                )
                continue
            if not isinstance(items, list):
                items = [items]
            calls += [_read_obj(x) for x in items]
        else:  # name[ARGS]{...} or name{...}
            name, sep, args = body.partition("[ARGS]")
            if not sep:
                at = body.find("{")
                name, args = (body[:at], body[at:]) if at >= 0 else (body, "")
            calls.append(_read_obj({"name": name.strip(), "arguments": args.strip() or {}}))
    return text[:first], calls


def _json_objects(body: str, sep: str) -> list[ToolCall]:
    """JSON objects one after the other, separated by `sep` (and white space)."""
    calls, pos, dec = [], 0, json.JSONDecoder()
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            break
        calls.append(_read_obj(obj))
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == sep):
            pos += 1
    return calls


def _read_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    return _read_obj(obj)


def _read_obj(obj: Any) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's wire format carries the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error='"arguments" must be a JSON object')
    return ToolCall(name=obj["name"], arguments=args)
