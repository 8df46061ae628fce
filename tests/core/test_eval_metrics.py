"""Tests for rlhf_batch.core.eval_metrics; every expected number is worked out in a comment."""

from __future__ import annotations

import pytest

from rlhf_batch.core.eval_metrics import (
    PromptSamples,
    aggregate,
    aggregate_by_source,
    best_at_n,
    group_samples,
    maj_at_n,
    mean_at_n,
    pass_at_k,
    prompt_metrics,
)

# ---------------------------------------------------------------- pass@k by hand


def test_pass_at_1_is_the_fraction_correct() -> None:
    # n=5, c=2, k=1: 1 - C(3,1)/C(5,1) = 1 - 3/5 = 0.4
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)


def test_pass_at_2_of_5_with_2_correct() -> None:
    # C(3,2) = 3 incorrect-only pairs out of C(5,2) = 10 pairs: 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)


def test_pass_at_5_of_10_with_3_correct() -> None:
    # C(7,5) = 21, C(10,5) = 252: 1 - 21/252 = 1 - 1/12 = 11/12 = 0.91666...
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12, abs=1e-15)


def test_pass_at_3_of_4_with_1_correct() -> None:
    # C(3,3) = 1, C(4,3) = 4: 1 - 1/4 = 0.75 (n - c = 3 = k: still the formula, not the shortcut)
    assert pass_at_k(4, 1, 3) == pytest.approx(0.75, abs=1e-15)


def test_pass_at_k_is_one_when_fewer_incorrect_than_k() -> None:
    # n=4, c=2, k=3: n - c = 2 < 3, so every 3-subset holds a correct sample -> exactly 1.0
    assert pass_at_k(4, 2, 3) == 1.0
    # k = n with one correct sample: n - c = 3 < 4 -> 1.0
    assert pass_at_k(4, 1, 4) == 1.0


def test_pass_at_k_is_zero_without_a_correct_sample() -> None:
    # c = 0: C(n, k)/C(n, k) = 1 -> exactly 0.0, for every k including k = n
    assert pass_at_k(6, 0, 1) == 0.0
    assert pass_at_k(6, 0, 6) == 0.0


def test_pass_at_k_all_correct_is_one() -> None:
    # c = n: n - c = 0 < k -> 1.0
    assert pass_at_k(3, 3, 1) == 1.0


def test_pass_at_k_large_n_does_not_overflow() -> None:
    # c = 1: C(n-1, k)/C(n, k) = (n-k)/n, so pass@k = k/n. n=10000, k=100 -> 0.01.
    # C(10000, 100) ~ 1e241 would overflow a float; the product form never forms it.
    assert pass_at_k(10_000, 1, 100) == pytest.approx(0.01, rel=1e-12)
    # c = 2, k = 1: 1 - (n-2)/n = 2/n = 2e-4
    assert pass_at_k(10_000, 2, 1) == pytest.approx(2e-4, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


# ---------------------------------------------------------------- mean, best, maj


def test_mean_and_best_at_n() -> None:
    # (0.0 + 1.0 + 0.5 + 0.5) / 4 = 0.5; best = 1.0
    assert mean_at_n([0.0, 1.0, 0.5, 0.5]) == 0.5
    assert best_at_n([0.0, 1.0, 0.5, 0.5]) == 1.0
    # negative rewards: best is the least negative
    assert best_at_n([-2.0, -0.5, -1.0]) == -0.5


def test_maj_at_n_votes_the_most_frequent_answer() -> None:
    # "4" twice, "5" once, one sample without answer: "4" wins, its samples are correct -> 1.0
    assert maj_at_n(["4", "5", "4", None], [True, False, True, False]) == 1.0
    # "5" twice (wrong), "4" once (right): majority is wrong -> 0.0
    assert maj_at_n(["5", "4", "5"], [False, True, False]) == 0.0


def test_maj_at_n_tie_goes_to_first_seen_and_no_answer_is_zero() -> None:
    # "7" and "8" once each: "7" seen first, it is wrong -> 0.0; swapped order -> 1.0
    assert maj_at_n(["7", "8"], [False, True]) == 0.0
    assert maj_at_n(["8", "7"], [True, False]) == 1.0
    assert maj_at_n([None, None], [False, False]) == 0.0


# ---------------------------------------------------------------- per prompt and aggregated


def test_prompt_metrics_threshold_and_names() -> None:
    # rewards 1, 0, 0.5, 1 with threshold 1.0: c = 2 of n = 4
    # mean = 2.5/4 = 0.625, best = 1.0, pass@1 = 2/4 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6
    g = PromptSamples("p", "math", (1.0, 0.0, 0.5, 1.0))
    m = prompt_metrics(g, ks=[1, 2])
    assert m == pytest.approx({"mean@4": 0.625, "best@4": 1.0, "pass@1": 0.5, "pass@2": 5 / 6}, abs=1e-15)
    # threshold 0.5: c = 3, pass@1 = 3/4 = 0.75, pass@2: n - c = 1 < 2 -> 1.0
    m = prompt_metrics(g, ks=[1, 2], threshold=0.5)
    assert (m["pass@1"], m["pass@2"]) == (0.75, 1.0)


def test_prompt_metrics_rejects_non_finite_rewards() -> None:
    with pytest.raises(ValueError, match="prompt 'p' has a non-finite reward nan"):
        prompt_metrics(PromptSamples("p", "s", (1.0, float("nan"))), ks=[1])


def test_aggregate_by_source_averages_prompts_per_source() -> None:
    # flat rows, n = 2 per prompt, as the eval parts would hold them
    groups = group_samples(
        prompt_ids=["a", "a", "b", "b", "c", "c"],
        data_sources=["gsm8k", "gsm8k", "gsm8k", "gsm8k", "math", "math"],
        rewards=[1.0, 0.0, 0.0, 0.0, 1.0, 1.0],
        answers=["3", "4", "9", None, "x", "x"],
    )
    by_src = aggregate_by_source(groups, ks=[1, 2])
    # gsm8k: a = (mean 0.5, best 1, pass@1 1/2, pass@2 1 [n-c=1<2], maj: tie 3/4 -> "3" right -> 1)
    #        b = (mean 0,   best 0, pass@1 0,   pass@2 0,            maj: "9" wrong -> 0)
    #        source = mean over the 2 prompts: 0.25, 0.5, 0.25, 0.5, 0.5
    assert by_src["gsm8k"] == pytest.approx(
        {"mean@2": 0.25, "best@2": 0.5, "pass@1": 0.25, "pass@2": 0.5, "maj@2": 0.5, "prompts": 2.0}
    )
    # math: one prompt, both correct: everything 1.0
    assert by_src["math"] == pytest.approx(
        {"mean@2": 1.0, "best@2": 1.0, "pass@1": 1.0, "pass@2": 1.0, "maj@2": 1.0, "prompts": 1.0}
    )
    assert list(by_src) == ["gsm8k", "math"]
    # all sources together: 3 prompts, mean@2 = (0.5 + 0 + 1) / 3 = 0.5, pass@1 = (0.5 + 0 + 1) / 3 = 0.5
    overall = aggregate(groups, ks=[1])
    assert (overall["mean@2"], overall["pass@1"], overall["prompts"]) == pytest.approx((0.5, 0.5, 3.0))


def test_aggregate_refuses_mixed_sample_counts_and_empty_is_empty() -> None:
    groups = [PromptSamples("a", "s", (1.0, 0.0)), PromptSamples("b", "s", (1.0,))]
    with pytest.raises(ValueError, match=r"different sample counts \[1, 2\]"):
        aggregate(groups, ks=[1])
    assert aggregate([], ks=[1]) == {}


def test_group_samples_refuses_a_prompt_with_two_sources() -> None:
    with pytest.raises(ValueError, match="prompt 'a' has two data sources"):
        group_samples(["a", "a"], ["x", "y"], [1.0, 0.0])
