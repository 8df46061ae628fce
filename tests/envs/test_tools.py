"""Built-in tools: the Python code tool in real child processes, the calculator, the parsing of
Hermes tool calls, and the tool environment's steps."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from rlhf_batch.envs import python_tool
from rlhf_batch.envs.base import Step
from rlhf_batch.envs.calculator import CalculatorError, calculate
from rlhf_batch.envs.python_tool import Limits, run_python, sandbox_problem
from rlhf_batch.envs.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCall,
    declared_format,
    parse_tool_calls,
    use_format,
)
from rlhf_batch.envs.tools import ToolEnvironment, tool_environment, tool_schemas

FAST = Limits(cpu_s=1, memory_mb=256, output_bytes=64_000, max_output=500, timeout_s=5.0)


@pytest.fixture(autouse=True)
def _weak_where_no_sandbox():  # noqa: ANN202
    """The limits hold in both modes: where this machine has no sandbox, the weak mode runs them."""
    python_tool.configure("weak" if sandbox_problem() else "required")
    yield
    python_tool.configure("required")


def test_code_runs_in_a_fresh_directory_and_prints():
    r = run_python("import os; print(6 * 7); print(os.listdir('.')); open('f', 'w').write('x')", FAST)
    assert (r.reason, r.returncode) == ("ok", 0)
    assert r.output == "42\n[]\n"  # an empty working directory
    again = run_python("import os; print(os.listdir('.'))", FAST)
    assert again.output == "[]\n"  # the file of the last call is gone with its directory


def test_cpu_time_bomb_is_stopped_by_the_cpu_limit():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", FAST)
    assert r.reason == "cpu_limit" and r.returncode < 0
    assert time.monotonic() - t0 < FAST.timeout_s  # the CPU limit, not the wall clock, ended it
    assert r.text().endswith("[killed: CPU time limit]")


def test_memory_bomb_fails_its_allocation():
    r = run_python("x = bytearray(1 << 30)\nprint('allocated')", FAST)  # 1 GiB > 256 MB
    assert r.reason == "error" and r.returncode == 1
    assert "MemoryError" in r.output and "allocated" not in r.output


def test_wall_clock_limit_kills_a_sleeper():
    limits = Limits(cpu_s=1, memory_mb=256, timeout_s=1.0)
    t0 = time.monotonic()
    r = run_python("import time\ntime.sleep(60)", limits)
    assert r.reason == "timeout" and r.returncode == -9
    assert time.monotonic() - t0 < 10


def test_output_flood_is_capped():
    r = run_python("while True:\n    print('x' * 1000)", FAST)
    assert r.reason == "output_limit"
    assert r.truncated and len(r.output) == FAST.max_output
    assert r.text().endswith("[output truncated]\n[killed: output size limit]")


def listener(
    family: int = socket.AF_INET, address: object = ("127.0.0.1", 0)
) -> tuple[socket.socket, list[int]]:
    """A server socket at `address` that accepts one connection (noted in the list) for 8 s."""
    srv = socket.socket(family)
    srv.bind(address)
    srv.listen()
    accepted: list[int] = []

    def serve() -> None:
        srv.settimeout(8)
        try:
            conn, _ = srv.accept()
            accepted.append(1)
            conn.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return srv, accepted


CONNECT = "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')"


def test_network_is_refused_in_the_sandbox():
    """Not even this machine's loopback is in reach (the weak mode's network: test_sandbox.py)."""
    if sandbox_problem() is not None:
        pytest.skip(f"no sandbox here: {sandbox_problem()}")
    srv, accepted = listener()
    try:
        r = run_python(CONNECT.format(port=srv.getsockname()[1]), FAST)
    finally:
        srv.close()
    assert r.network_isolated and r.reason == "error"
    assert "connected" not in r.output and not accepted
    assert "Network is unreachable" in r.output


def test_calculator():
    # worked by hand: 2 * (3 + 4) ** 2 = 2 * 49 = 98; 7 // 2 = 3; -3 % 5 = 2 (Python's modulo)
    assert calculate("2 * (3 + 4) ** 2") == 98
    assert calculate("7 // 2 + -3 % 5") == 5
    assert calculate("sqrt(16) / 8") == 0.5
    for bad, why in [
        ("__import__('os').system('true')", "unsupported expression"),
        ("(1).__class__", "unsupported expression"),
        ("2 ** 10000", "exponent 10000 is larger than 1000"),
        ("1 / 0", "ZeroDivisionError"),
        ("2 +", "not an arithmetic expression"),
        ("'a' * 3", "unsupported expression"),
    ]:
        with pytest.raises(CalculatorError, match=why.replace("(", r"\(")):
            calculate(bad)


def test_parse_hermes_calls_and_malformed_ones():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>{name: calculator}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "python"'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute.\n"
    assert [(c.name, c.arguments) for c in calls[:2]] == [
        ("calculator", {"expression": "1+2"}),
        ("python", {"code": "print(1)"}),  # OpenAI's JSON-string arguments are read too
    ]
    assert calls[2].error.startswith("the tool call is not valid JSON")
    assert calls[3].error.startswith("a tool call is a JSON object")
    assert calls[4].error == '"arguments" must be a JSON object'
    assert calls[5].error == "<tool_call> is not closed by </tool_call>"
    assert parse_tool_calls("no call here") == ("no call here", [])


QWEN25_TOOL_LINES = (  # the tool-call part of Qwen2.5-Instruct's chat template
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '</tool_call>' }}"
)


def test_the_format_is_read_from_the_chat_template(tiny_model: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert declared_format(tok.chat_template) is HERMES
    assert declared_format(QWEN25_TOOL_LINES) is HERMES
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert declared_format(plain) is None


def test_environment_steps():
    env = tool_environment({"prompt": "x", "tools": ["calculator"]})
    done = env.step("The answer is 4.")
    assert done == Step(observation=None, reward_parts={"tool_calls": 0.0, "tool_errors": 0.0}) and done.ends
    step = env.step(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    assert step.role == "tool" and not step.ends
    results = step.observation  # one tool message per call
    assert len(results) == 3 and results[0] == "42"
    assert results[1] == "Error: unknown tool 'python' (tools: calculator)"
    assert results[2].startswith("Error: the tool call is not valid JSON")
    assert step.reward_parts == {"tool_calls": 3.0, "tool_errors": 2.0}


def test_environment_runs_python_and_caps_calls_per_turn():
    env = ToolEnvironment(max_calls=1)
    call = json.dumps({"name": "python", "arguments": {"code": "print(sum(range(10)))"}})
    step = env.step(f"<tool_call>{call}</tool_call><tool_call>{call}</tool_call>")
    assert step.observation == ["45\n", "Error: at most 1 tool calls are run per turn"]
    assert tool_environment({"tools": "python, calculator"}).tools.keys() == {"python", "calculator"}
    assert [s["function"]["name"] for s in tool_schemas()] == ["python", "calculator"]
    schemas = json.dumps(tool_schemas(["calculator"]))  # the schemas an imported row carries
    assert tool_environment({"tools": schemas}).tools.keys() == {"calculator"}
    with pytest.raises(ValueError, match="unknown tool 'bash'"):
        tool_environment({"tools": ["bash"]})
    assert os.environ.get("HOME")  # the tool's own $HOME did not leak into this process


def test_tiny_template_renders_plain_chats_as_before_and_tool_results_as_qwen():
    from rlhf_batch.models.tiny import build_tokenizer

    tok = build_tokenizer()
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    # the plain ChatML rendering, written out: what the demo's chat prompts have always rendered
    plain = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert tok.apply_chat_template(chat, tokenize=False) == plain
    assert tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    tools = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert tok.apply_chat_template([*chat, *tools], tokenize=False) == plain + (
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
    )


def test_a_call_without_arguments_has_empty_arguments():
    # {"name": "python"} with no "arguments" key: the call is read, its arguments {} (the tool
    # then says what it takes), not refused as a malformed call
    _, calls = parse_tool_calls('<tool_call>{"name": "python"}</tool_call>')
    assert calls == [ToolCall(name="python", arguments={}, error="")]
    _, calls = parse_tool_calls('{"name": "calculator"}', LLAMA3_JSON)
    assert calls == [ToolCall(name="calculator", arguments={}, error="")]
    step = ToolEnvironment().step('<tool_call>{"name": "calculator"}</tool_call>')
    assert step.observation == ['Error: calculator takes {"expression": "<arithmetic>"}']


# The tool-call parts of Llama 3.1's and Mistral-7B-Instruct-v0.3's chat templates (their
# assistant tool calls and tool results), around the tiny character-level vocabulary.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- if not message.tool_calls|length == 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{- message.content }}{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content "
    "| trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}"
    "{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}"
    "{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}{%- endfor %}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    '{{- \'[TOOL_RESULTS] {"content": \' + message.content|string + \', "call_id": "\' + message.tool_call_id'
    " + '\"}[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}"
)


@pytest.mark.parametrize(
    ("template", "fmt", "n_calls"),
    [(None, HERMES, 2), (LLAMA31_TEMPLATE, LLAMA3_JSON, 1), (MISTRAL_TEMPLATE, MISTRAL, 2)],
)
def test_each_parser_reads_its_templates_own_calls(template, fmt, n_calls):
    from rlhf_batch.models.tiny import build_tokenizer

    tok = build_tokenizer()
    if template is not None:
        tok.chat_template = template
    assert declared_format(tok.chat_template) is fmt
    want = [("calculator", {"expression": "6*7"}), ("python", {"code": "print('a; b')"})][:n_calls]
    calls = [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(want)
    ]
    user = {"role": "user", "content": "hi"}
    before = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(
        [user, {"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False
    )
    turn = full[len(before) :] if full.startswith(before) else full[full.index("[/INST]") + len("[/INST]") :]
    turn = turn.removesuffix("<|eot_id|>")  # Llama's stop token: the environment gets the turn without it
    assert fmt.start in turn or fmt is LLAMA3_JSON
    content, got = parse_tool_calls(turn, fmt)
    assert [(c.name, c.arguments, c.error) for c in got] == [(n, a, "") for n, a in want]
    assert content.strip() == ""
    # use_format makes it what a ToolEnvironment reads (as generate.tool_parser does in a worker)
    try:
        use_format(fmt.name)
        step = ToolEnvironment().step(turn)
    finally:
        use_format("hermes")
    assert step.observation[0] == "42" and len(step.observation) == n_calls


def test_llama3_and_mistral_variants():
    # Llama: <|python_tag|>, several calls separated by ';'; a turn not starting with a call has none
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, LLAMA3_JSON)[1]] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert parse_tool_calls('The call is {"name": "a"}', LLAMA3_JSON) == ('The call is {"name": "a"}', [])
    assert parse_tool_calls('{"name": "a", ', LLAMA3_JSON)[1][0].error.startswith(
        "the tool call is not valid JSON"
    )
    # Mistral: content before the calls; the newer tokenizers' name[ARGS]{...} form
    content, calls = parse_tool_calls('Sure.[TOOL_CALLS]calculator[ARGS]{"expression": "1+2"}', MISTRAL)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("calculator", {"expression": "1+2"})
    ]
    assert parse_tool_calls("[TOOL_CALLS] [not json", MISTRAL)[1][0].error.startswith(
        "the tool calls are not valid"
    )
