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
