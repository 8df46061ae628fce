"""A verifiable math reward: the response's answer against the prompt's ground truth, with
Math-Verify (the parser and equivalence checker TRL and verl use).

The ground truth is the `answer` column (GSM8K's ``... #### 42`` keeps the part after ``####``)
or, for verl data, `ground_truth`. Both sides are parsed by ``math_verify.parse`` (LaTeX such as
``\\boxed{\\frac{1}{3}}``, or plain expressions after anchors such as "The answer is") and
compared by ``math_verify.verify`` (symbolic and numeric equivalence). Parsing and comparing
each have a time limit of `TIMEOUT_SECONDS` per call; a comparison that runs out of time scores
0. A ground truth Math-Verify cannot parse is compared as text with the final answer (the last
``\\boxed{}`` or number). A row without a ground truth cannot be scored (None).

>>> exact_answer(prompts=["q"], responses=["so it is \\\\boxed{\\\\frac{1}{3}}"], answer=["\\\\frac{1}{3}"])
[1.0]
>>> exact_answer(prompts=["q", "q"], responses=["The answer is 1/2.", "no idea"], answer=["1/2", "1/2"])
[1.0, 0.0]
>>> compute_score("gsm8k", "3 + 4 = 7, so \\\\boxed{7}", "7")
1.0
"""

from __future__ import annotations

import re
import threading
from typing import Any

TIMEOUT_SECONDS = 5  # per parse and per comparison (Math-Verify's signal-based limit)

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, else the last number (the text fallback)."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _timeout(seconds: int) -> int | None:
    # Math-Verify's limit uses signal.alarm, which only the main thread may set
    return seconds if threading.current_thread() is threading.main_thread() else None


def math_equal(response: str, truth: str, timeout_seconds: int = TIMEOUT_SECONDS) -> float:
    """1.0 when the response's answer is equivalent to `truth`, else 0.0."""
    from math_verify import parse, verify

    limit = _timeout(timeout_seconds)
    gold = parse(truth, parsing_timeout=limit)  # type: ignore[arg-type]
    if not gold:
        got = final_answer(response)
        return float(got is not None and got.replace(",", "").strip() == truth.replace(",", "").strip())
    pred = parse(response, parsing_timeout=limit)  # type: ignore[arg-type]
    return float(bool(pred) and verify(gold, pred, timeout_seconds=limit))


def _truth(value: Any) -> str | None:
    if value is None or str(value).strip() == "":
        return None
    return str(value).split("####")[-1].strip()


def exact_answer(
    *,
    prompts: list[str],
    responses: list[str],
    answer: list[Any] | None = None,
    ground_truth: list[Any] | None = None,
    **_: Any,
) -> list[float | None]:
    """Reward function (batched): 1.0 when the response's answer is equivalent to the ground
    truth (`answer`, else `ground_truth`), 0.0 otherwise, None without one."""
    truths = answer if answer is not None else ground_truth
    if truths is None:
        truths = [None] * len(responses)
    out: list[float | None] = []
    for response, want in zip(responses, truths, strict=True):
        truth = _truth(want)
        out.append(None if truth is None else math_equal(response, truth))
    return out


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float | None:
    """verl's signature: use as ``"verl:rlhf_batch.rewards.math:compute_score"``; None (the row is
    not scored) without a ground truth, as `exact_answer`."""
    truth = _truth(ground_truth)
    return None if truth is None else math_equal(solution_str, truth)
