"""The demo task: write a given letter N times, then stop. Procedural, so no download.

A prompt reads ``c*3=`` and the ideal response is ``ccc`` followed by EOS. The reward gives
partial credit, so even a random model's samples differ and GRPO has a signal:

    score = (correct letters among the first N characters) / max(N, len(response))

which is 1.0 for exactly N copies, and less for wrong letters, too few, or extra characters.

>>> letter_count(prompts=["c*3="], responses=["ccc"], response_ids=[[1, 2, 3]], letter=["c"], count=[3])
[1.0]
>>> letter_count(prompts=["c*3="], responses=["cxcc"], response_ids=[[1, 2, 3, 4]], letter=["c"], count=[3])
[0.5]
"""

from __future__ import annotations

from typing import Any


def letter_count(
    *, prompts: list[str], responses: list[str], letter: list[str], count: list[int], **_: Any
) -> list[float | None]:
    """Reward function (batched): the share of the target string the response got right."""
    out: list[float | None] = []
    for response, c, n in zip(responses, letter, count, strict=True):
        if not c or n is None or n < 1:
            out.append(None)  # not a demo prompt: cannot score
            continue
        hits = sum(ch == c for ch in response[:n])
        out.append(hits / max(n, len(response)))
    return out


ASKED_WEIGHT = 0.2  # the multi-turn demo: asking first is worth a little, the answer the rest


def ask_letter(*, env_answer: list[float], env_asked: list[float], **_: Any) -> list[float | None]:
    """Reward function of the multi-turn demo task (rlhf_batch.envs.demo), from the environment's
    reward parts: 0.2 x asked (1.0 for asking with exactly "?", partial credit for "?" and more)
    + 0.8 x the answer's letter_count score, so 1.0 at best.

    >>> ask_letter(env_answer=[1.0, 0.5], env_asked=[1.0, 0.0])
    [1.0, 0.4]
    """
    w = ASKED_WEIGHT
    return [w * q + (1 - w) * a for a, q in zip(env_answer, env_asked, strict=True)]


CALL_WEIGHT = 0.2  # the calculator task: calling the calculator is worth a little, the answer the rest


def digits(text: str, want: str) -> float:
    """letter_count's score for a string: the share of `want` that `text` got right, position by
    position, over max(len(want), len(text))."""
    return sum(a == b for a, b in zip(text, want, strict=False)) / max(len(want), len(text), 1)


def calculator(
    *,
    completion_messages: list[list[dict[str, Any]]],
    answer: list[str],
    expression: list[str],
    env_tool_calls: list[float] | None = None,
    env_tool_errors: list[float] | None = None,
    **_: Any,
) -> list[float | None]:
    """Reward function of the calculator task (prompt "37*58=", answer "2146"):

        0.2 x call + 0.8 x answer

    answer: the digits of the product that the last assistant message got right (`digits`),
    never a tool's output; call, with the built-in tool environment (`env_tool_calls`,
    `env_tool_errors`): 1/3 for calling a tool, 1/3 for a call that ran without error, 1/3 x
    the digits of the prompt's expression that the first call's `expression` got right (partial
    credit, so that GRPO has a signal on the call before the model writes one whole). Without
    the environment (no tools) the call part is 0: the answer must come from the model alone.

    >>> calculator(completion_messages=[[{"role": "assistant", "content": "2146"}]], answer=["2146"], expression=["37*58"])
    [0.8]
    """
    n = len(answer)
    calls, errors = env_tool_calls or [0.0] * n, env_tool_errors or [0.0] * n
    out: list[float | None] = []
    for msgs, want, expr, c, e in zip(completion_messages, answer, expression, calls, errors, strict=True):
        said = [m for m in msgs if m["role"] == "assistant"]
        first = next((m["tool_calls"][0] for m in said if m.get("tool_calls")), None)
        typed = (first or {}).get("function", {}).get("arguments", {}).get("expression", "")
        call = (float(c > 0) + float(c > 0 and e == 0) + digits(str(typed), expr)) / 3
        text = said[-1]["content"] if said else ""
        out.append(CALL_WEIGHT * call + (1 - CALL_WEIGHT) * digits(text, want))
    return out
