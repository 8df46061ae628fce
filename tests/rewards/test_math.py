"""The math reward: Math-Verify parsing and equivalence, with a time limit per call."""

from __future__ import annotations

import time

import pytest

from rlhf_batch.rewards.math import compute_score, exact_answer, math_equal


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so the result is \\boxed{\\frac{1}{3}}", "\\frac{1}{3}", 1.0),  # LaTeX on both sides
        ("The answer is 1/2.", "1/2", 1.0),  # an anchored plain expression
        ("The answer is 0.5.", "\\frac{1}{2}", 1.0),  # numeric equivalence
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # symbolic equivalence
        ("\\boxed{\\frac{1}{4}}", "\\frac{1}{3}", 0.0),
        ("I do not know", "7", 0.0),
    ],
)
def test_math_verify_equivalence(response: str, truth: str, expected: float) -> None:
    assert math_equal(response, truth) == expected


def test_ground_truth_from_answer_or_verl_column_gsm8k_marker_and_none() -> None:
    responses = ["... so \\boxed{72}", "It is 72.", "\\boxed{3}"]
    assert exact_answer(prompts=["q"] * 3, responses=responses, answer=["#### 72", "72", None]) == [
        1.0,
        1.0,
        None,
    ]
    assert exact_answer(prompts=["q"] * 2, responses=responses[:2], ground_truth=["72", "71"]) == [1.0, 0.0]
    assert compute_score("openai/gsm8k", "\\boxed{\\frac{1}{3}}", "\\frac{1}{3}") == 1.0
    assert compute_score("openai/gsm8k", "whatever", None) is None  # not scored, as exact_answer's rows
    assert compute_score("openai/gsm8k", "whatever", "  ") is None


def test_a_comparison_that_runs_out_of_time_scores_zero() -> None:
    # 9^(9^(9^9)) against 1: sympy would work on it far longer than the 1 s limit
    start = time.monotonic()
    assert math_equal("\\boxed{9^{9^{9^{9}}}}", "1", timeout_seconds=1) == 0.0
    assert time.monotonic() - start < 10
