"""An LLM judge's prompts and verdicts (stages/score/judge.py runs the judge): the default templates
and patterns of the two modes, the template's fields, and the scores parsed out of a verdict.
Pure text functions: no model, no I/O."""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

RUBRIC = (
    "A good response does what the prompt asks, correctly and completely; a response that "
    "does less, or does something else, is worse."
)
TEMPLATES = {
    "pointwise": (
        "Grade the response to the prompt below.\n{rubric}\n\n"
        "Prompt:\n{prompt}\n\nResponse:\n{response}\n\n"
        "Answer with one line 'Score: N', N from 0 (worst) to 10 (best)."
    ),
    "group": (
        "Compare the {n} responses to the prompt below and grade each relative to the others.\n"
        "{rubric}\n\nPrompt:\n{prompt}\n\n{responses}\n\n"
        "Answer with one line per response, 'K: N', K the response's number and N its score "
        "from 0 (worst) to 10 (best)."
    ),
}
PATTERNS = {
    "pointwise": r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
    "group": r"(?im)^\W*(?:response\s*)?(\d+)\W*[:=]\s*(-?\d+(?:\.\d+)?)",
}
FIELDS = {"pointwise": {"prompt", "response", "rubric"}, "group": {"prompt", "responses", "rubric", "n"}}


def template_fields(template: str) -> set[str]:
    """The ``{field}`` names of a format template; ValueError when it does not parse."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def template_problem(template: str, mode: str, columns: Sequence[str]) -> str:
    """Why `template` cannot be rendered for rows with carried `columns` ("" when it can)."""
    known = FIELDS[mode] | set(columns)  # a group's carried columns: its first row's
    try:
        unknown = sorted(template_fields(template) - known)
    except ValueError as e:
        return f"score.judge_template: {e} (write a literal brace as {{{{ or }}}})"
    if unknown:
        return (
            f"score.judge_template: no field {{{unknown[0]}}} in {mode} mode "
            f"(fields: {', '.join(sorted(known))})"
        )
    return ""


def pattern_problem(pattern: str, mode: str) -> str:
    """Why `pattern` is no judge pattern for `mode` ("" when it is): it compiles, with one group
    (pointwise: the score) or two (group: the response's number, its score)."""
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        return f"score.judge_pattern: not a regular expression ({e})"
    want = 1 if mode == "pointwise" else 2
    if groups < want:
        return f"score.judge_pattern: needs {want} group(s) in {mode} mode, has {groups}"
    return ""


def _number(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse_pointwise(verdict: str, pattern: str) -> float | None:
    """The first match's first group as a finite float, else None."""
    m = re.search(pattern, verdict)
    return _number(m.group(1)) if m else None


def parse_group(verdict: str, pattern: str, n: int) -> list[float | None]:
    """Scores of responses 1..n: each match gives (number, score); the first match of a number
    counts, numbers outside 1..n are passed over, a number without a match gets None."""
    out: list[float | None] = [None] * n
    for m in re.finditer(pattern, verdict):
        k = int(m.group(1)) if m.group(1).isdigit() else 0
        if 1 <= k <= n and out[k - 1] is None:
            out[k - 1] = _number(m.group(2))
    return out


def numbered(responses: Sequence[str]) -> str:
    """The group's responses as the ``{responses}`` field: ``Response K:`` then its text."""
    return "\n\n".join(f"Response {k}:\n{r}" for k, r in enumerate(responses, start=1))


def groups_of(prompt_ids: Sequence[str]) -> list[list[int]]:
    """Row numbers per prompt id, in order of first appearance (rows keep their order)."""
    at: dict[str, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        at.setdefault(p, []).append(i)
    return list(at.values())
