"""Seeded per-batch quotas of a weighted prompt mixture, and each source's own order."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf_batch.core.mixtures import SourceTake, check, quotas, rows_for, spec_problem, takes


def test_whole_shares_need_no_draw() -> None:
    # weights 2:1 of B = 3: expected shares 2 and 1 exactly, every batch
    assert {tuple(quotas(k, [2.0, 1.0], 3, seed=7)) for k in range(50)} == {(2, 1)}


def test_the_remainder_goes_by_systematic_sampling() -> None:
    # weights 1:1 of B = 3: shares 1.5 and 1.5, floors 1 and 1, one prompt left; fractional
    # parts 0.5 and 0.5: source 0 gets it when the batch's uniform u < 0.5, else source 1
    for k in range(20):
        u = np.random.default_rng([5, k]).random()
        assert quotas(k, [1.0, 1.0], 3, seed=5) == ([2, 1] if u < 0.5 else [1, 2])


def test_quotas_sum_to_b_stay_within_one_and_average_to_the_weights() -> None:
    weights, b = [0.5, 0.3, 0.2], 7  # expected 3.5, 2.1, 1.4
    got = np.array([quotas(k, weights, b, seed=1) for k in range(4000)])
    assert (got.sum(axis=1) == b).all()
    assert set(got[:, 0]) == {3, 4} and set(got[:, 1]) == {2, 3} and set(got[:, 2]) == {1, 2}
    # a source gets floor + 1 with probability equal to its fractional part (0.5, 0.1, 0.4)
    assert got.mean(axis=0) == pytest.approx([3.5, 2.1, 1.4], abs=0.03)


def test_each_source_reads_its_epochs_and_drops_a_short_tail() -> None:
    # sizes 3 and 5, weights 2:1, B = 3: quotas 2 and 1 every batch. Source 0 takes [0, 2) of
    # epoch 0; batch 1 would need positions 2..3 of 3: the tail is dropped, epoch 1 starts.
    assert takes(0, [3, 5], [2.0, 1.0], 3, 0) == [SourceTake(2, 0, 0, 2), SourceTake(1, 0, 0, 1)]
    assert takes(1, [3, 5], [2.0, 1.0], 3, 0) == [SourceTake(2, 1, 0, 2), SourceTake(1, 0, 1, 2)]
    assert takes(5, [3, 5], [2.0, 1.0], 3, 0) == [SourceTake(2, 5, 0, 2), SourceTake(1, 1, 0, 1)]
    # rows of the concatenated set: source 1's rows start at 3
    _, rows = rows_for(5, [3, 5], [2.0, 1.0], 3, 0)
    assert rows == [
        *np.random.default_rng([0, 1, 5]).permutation(3)[0:2].tolist(),
        *(np.random.default_rng([0, 2, 1]).permutation(5)[0:1] + 3).tolist(),
    ]


def test_bad_mixtures_are_named() -> None:
    with pytest.raises(ValueError, match="source 1 has 1 prompts, fewer than its quota of up to 2"):
        check([10, 1], [1.0, 1.0], 3)
    assert "prompts_per_iteration" in spec_problem([{"path": "a", "weight": 1}], 0)
    assert "'weight' must be a number > 0" in spec_problem([{"path": "a", "weight": 0}], 2)
    assert "unknown key 'wieght'" in spec_problem([{"path": "a", "wieght": 1}], 2)
    assert "same name" in spec_problem([{"path": "a", "weight": 1}, {"path": "a", "weight": 2}], 2)
    assert "mixes paths" in spec_problem(["b", {"path": "a", "weight": 1}], 2)
    assert spec_problem([{"path": "a", "weight": 1}, {"path": "a", "weight": 2, "name": "x"}], 2) == ""
