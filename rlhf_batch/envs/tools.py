"""Built-in tools and the tool-using environment (`generate.environment =
"rlhf_batch.envs.tools:tool_environment"`).

Each assistant turn is parsed for tool calls in the format `generate.tool_parser` names
(tool_calls.py; default Hermes); every call (at most `max_calls` a turn) is run and each result
comes back as a message of role "tool" of its own, in call order, as Qwen's template and
`import` take several calls of one turn. A turn without a call ends the trajectory. A
call that cannot be read, names an unknown tool or has bad arguments is answered with an
"Error: ..." result, and the trajectory goes on. Reward parts: `tool_calls` and `tool_errors`
(summed over the trajectory, read by score as `env_tool_calls`, `env_tool_errors`).

Tools: `python` (python_tool.py: a child process with CPU, memory, output and time limits, in
PID, mount and network namespaces that end everything it starts with the call; it still reads
and writes the caller's files, docs/trajectories.md) and `calculator` (calculator.py).
Which ones a trajectory has: the prompt row's `tools` column (a list of names, one
comma-separated string, or the tool schemas as OpenAI function objects or their JSON), else both. Limits other than the defaults: write a factory of your
own, e.g. `def my_env(row): return ToolEnvironment({"python": PythonTool(Limits(cpu_s=2))})`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf_batch.envs.base import Step
from rlhf_batch.envs.calculator import CalculatorError, calculate
from rlhf_batch.envs.python_tool import Limits, run_python
from rlhf_batch.envs.tool_calls import ToolCall, ToolCallFormat, configured_format, parse_tool_calls


class Tool(Protocol):
    def schema(self) -> dict[str, Any]: ...  # OpenAI function schema, for the prompt's `tools`

    def __call__(self, arguments: dict[str, Any]) -> str: ...


@dataclass(frozen=True)
class PythonTool:
    limits: Limits = Limits()

    def schema(self) -> dict[str, Any]:
        return _function(
            "python",
            "Run Python code and return what it prints (stdout and stderr). No network, "
            f"{self.limits.cpu_s} s of CPU, {self.limits.memory_mb} MB of memory.",
            {"code": "the Python code to run"},
        )

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'Error: python takes {"code": "<python source>"}'
        return run_python(code, self.limits).text()


@dataclass(frozen=True)
class Calculator:
    def schema(self) -> dict[str, Any]:
        return _function(
            "calculator",
            "Evaluate an arithmetic expression (+ - * / // % **, parentheses, sqrt, log, ...).",
            {"expression": "the expression, e.g. 2 * (3 + 4)"},
        )

    def __call__(self, arguments: dict[str, Any]) -> str:
        expr = arguments.get("expression")
        if not isinstance(expr, str):
            return 'Error: calculator takes {"expression": "<arithmetic>"}'
        try:
            return str(calculate(expr))
        except CalculatorError as e:
            return f"Error: {e}"


BUILTIN: dict[str, Tool] = {"python": PythonTool(), "calculator": Calculator()}


@dataclass
class ToolEnvironment:
    tools: dict[str, Tool] = field(default_factory=lambda: dict(BUILTIN))
    max_calls: int = 4  # calls run per assistant turn; more are answered with an error
    fmt: ToolCallFormat = field(default_factory=configured_format)  # generate.tool_parser

    def step(self, assistant_text: str) -> Step:
        _, calls = parse_tool_calls(assistant_text, self.fmt)
        if not calls:  # the parts still, so a part whose trajectories call no tool has their columns
            return Step(observation=None, reward_parts={"tool_calls": 0.0, "tool_errors": 0.0})
        results = [
            self._run(c) if i < self.max_calls else _too_many(self.max_calls) for i, c in enumerate(calls)
        ]
        errors = sum(r.startswith("Error: ") for r in results)
        return Step(
            observation=results,  # one tool message per call
            role="tool",
            reward_parts={"tool_calls": float(len(calls)), "tool_errors": float(errors)},
        )

    def _run(self, call: ToolCall) -> str:
        if call.error:
            return f"Error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r} (tools: {', '.join(sorted(self.tools))})"
        try:
            return tool(call.arguments)
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation
            return f"Error: {call.name} failed: {type(e).__name__}: {e}"


def _too_many(n: int) -> str:
    return f"Error: at most {n} tool calls are run per turn"


def _function(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(params)},
        },
    }


def tool_schemas(names: list[str] | None = None) -> list[dict[str, Any]]:
    """The built-in tools' schemas (for `apply_chat_template(tools=...)` or an import's `tools`)."""
    return [BUILTIN[n].schema() for n in (names or list(BUILTIN))]


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A prompt row's `tools` as `apply_chat_template(tools=...)` takes them: tool schemas (a
    list of OpenAI function objects, or its JSON string) as they are; names (a list of names or
    one comma-separated string) as the built-in tools' schemas; None when there are none.
    ValueError for a name that is no built-in tool."""
    if tools is None or (isinstance(tools, str) and not tools.strip()):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            tools = [n.strip() for n in tools.split(",") if n.strip()]
    if isinstance(tools, dict | str):
        tools = [tools]
    if not isinstance(tools, list) or not tools:
        return None
    if all(isinstance(t, dict) for t in tools):
        return [{k: v for k, v in t.items() if v is not None} for t in tools]
    names = tool_names(tools)
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise ValueError(f"unknown tool {unknown[0]!r} (built-in: {', '.join(BUILTIN)}; or give its schema)")
    return tool_schemas(names)


def tool_environment(row: dict[str, Any]) -> ToolEnvironment:
    """The environment of one trajectory: the row's `tools`, else every built-in tool."""
    names = tool_names(row.get("tools"))
    if not names:
        return ToolEnvironment()
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise ValueError(f"column 'tools': unknown tool {unknown[0]!r} (built-in: {', '.join(BUILTIN)})")
    return ToolEnvironment({n: BUILTIN[n] for n in names})


def python_environment(row: dict[str, Any]) -> ToolEnvironment:
    return ToolEnvironment({"python": BUILTIN["python"]})


def calculator_environment(row: dict[str, Any]) -> ToolEnvironment:
    return ToolEnvironment({"calculator": BUILTIN["calculator"]})


# the reward parts every trajectory of these environments gets (validate checks env_<name> against them)
for _factory in (tool_environment, python_environment, calculator_environment):
    _factory.reward_parts = ("tool_calls", "tool_errors")  # type: ignore[attr-defined]


def tool_names(tools: Any) -> list[str]:
    """Names from a `tools` value: a list of names, one comma-separated string, or the tool
    schemas (a list of OpenAI function schemas, or its JSON string, as `import` rows carry)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return [n.strip() for n in tools.split(",") if n.strip()]
    if isinstance(tools, str):
        tools = [tools]
    out = []
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else None
        out.append(f.get("name") if isinstance(f, dict) else t)
    return [str(n) for n in out]
