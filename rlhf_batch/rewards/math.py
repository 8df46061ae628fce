"""A verifiable math reward: the response's final answer against the prompt's `answer` column.

The final answer is the content of the last ``\\boxed{...}``, or else the last number in the
response. Numbers compare numerically (``1,000`` == ``1000.0``), anything else as stripped text.
A row without an answer cannot be scored (None).

>>> exact_answer(prompts=["q"], responses=["so it is \\\\boxed{42}"], answer=["42"])
[1.0]
>>> exact_answer(prompts=["q", "q"], responses=["about 3.50 dollars", "no idea"], answer=["3.5", "3.5"])
[1.0, 0.0]
"""

from __future__ import annotations

import re
from typing import Any

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _same(got: str, want: str) -> bool:
    try:
        return float(got.replace(",", "")) == float(want.replace(",", ""))
    except ValueError:
        return got.strip() == want.strip()


def exact_answer(
    *, prompts: list[str], responses: list[str], answer: list[Any], **_: Any
) -> list[float | None]:
    """1.0 when the final answer equals the `answer` column, else 0.0; None without an answer."""
    out: list[float | None] = []
    for response, want in zip(responses, answer, strict=True):
        if want is None or str(want).strip() == "":
            out.append(None)
            continue
        got = final_answer(response)
        out.append(float(got is not None and _same(got, str(want).split("####")[-1].strip())))
    return out
