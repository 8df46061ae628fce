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

from rlhf_batch.envs.demo import (
    ASKED_WEIGHT,
    CALL_CLOSE,
    CALL_OPEN,
    CALL_WEIGHT,
    TURN_END,
    call_units,
    units_share,
)


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


def ask_letter(*, env_answer: list[float], env_asked: list[float], **_: Any) -> list[float | None]:
    """Reward function of the multi-turn demo task (rlhf_batch.envs.demo), from the environment's
    reward parts: 0.2 x asked (1.0 for asking with exactly "?", partial credit for "?" and more)
    + 0.8 x the answer's letter_count score, so 1.0 at best.

    >>> ask_letter(env_answer=[1.0, 0.5], env_asked=[1.0, 0.0])
    [1.0, 0.4]
    """
    w = ASKED_WEIGHT
    return [w * q + (1 - w) * a for a, q in zip(env_answer, env_asked, strict=True)]


def digits(text: str, want: str) -> float:
    """letter_count's score for a string: the share of `want` that `text` got right, position by
    position, over max(len(want), len(text))."""
    return units_share(list(text), list(want))


def calculator(
    *,
    responses: list[str],
    completion_messages: list[list[dict[str, Any]]],
    answer: list[str],
    expression: list[str],
    **_: Any,
) -> list[float | None]:
    """Reward function of the calculator task (prompt "37*58=", answer "2146"), for the tiny model
    with the calculator's tokens and the ChatML template:

        0.2 x call + 0.8 x answer

    answer: the digits of the product that the last assistant message got right (`digits`),
    never a tool's output; call: the share of the right call (its opening, the prompt's
    expression character by character, its closing: 7 tokens for "37*58") that the first
    assistant turn (the response up to its first <|im_end|>) got right, token by token, so that
    GRPO has a signal on the call before the model writes one whole. Without tools (single-turn)
    the same: a call written then is text, which no tool answers.

    >>> calculator(responses=["2146"], completion_messages=[[{"role": "assistant", "content": "2146"}]], answer=["2146"], expression=["37*58"])
    [0.8]
    """
    out: list[float | None] = []
    for response, msgs, want, expr in zip(responses, completion_messages, answer, expression, strict=True):
        first = response.split(TURN_END, 1)[0].removesuffix("<|endoftext|>")
        call = units_share(call_units(first), [CALL_OPEN, *expr, CALL_CLOSE])
        said = [m for m in msgs if m["role"] == "assistant"]
        text = said[-1]["content"] if said else ""
        out.append(CALL_WEIGHT * call + (1 - CALL_WEIGHT) * digits(text, want))
    return out
