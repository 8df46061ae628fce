"""rlhf_batch.core.batching.aligned_chunks: two part lists cut into chunks of the same rows."""

from __future__ import annotations

from rlhf_batch.core.batching import aligned_chunks


def test_chunks_cut_only_at_common_boundaries() -> None:
    # a: 4 parts of 4 rows (boundaries 4, 8, 12, 16); b: 8 parts of 2 (2, 4, ..., 16).
    # 2 chunks of ~8 rows: the first common boundary at >= 16 / 2 = 8 is a[:2] = b[:4]
    assert aligned_chunks([4] * 4, [2] * 8, 2) == [(range(0, 2), range(0, 4)), (range(2, 4), range(4, 8))]
    # a: 3 + 3 (3, 6), b: 2 + 2 + 2 (2, 4, 6): the only common boundary inside is the end
    assert aligned_chunks([3, 3], [2, 2, 2], 4) == [(range(0, 2), range(0, 3))]


def test_chunks_of_roughly_equal_rows() -> None:
    # 10 parts of 1 row on both sides, 3 chunks: cuts at the first boundaries >= 10/3, 20/3, 10
    # = 4, 7, 10
    assert aligned_chunks([1] * 10, [1] * 10, 3) == [
        (range(0, 4), range(0, 4)),
        (range(4, 7), range(4, 7)),
        (range(7, 10), range(7, 10)),
    ]
    assert aligned_chunks([1] * 10, [1] * 10, 1) == [(range(0, 10), range(0, 10))]


def test_different_totals_and_empty_sides() -> None:
    # a holds 4 rows, b 5: common boundary at 2 (a[:1] = b[:1]); the rest is one chunk
    assert aligned_chunks([2, 2], [2, 3], 2) == [(range(0, 1), range(0, 1)), (range(1, 2), range(1, 2))]
    assert aligned_chunks([5], [], 4) == [(range(0, 1), range(0, 0))]
    # a trailing empty part joins the last chunk (still at most 2 chunks)
    assert aligned_chunks([2, 2, 0], [2, 2], 2) == [(range(0, 1), range(0, 1)), (range(1, 3), range(1, 2))]
    # no rows at all: one chunk with every part
    assert aligned_chunks([0, 0], [0], 3) == [(range(0, 2), range(0, 1))]


def test_token_budget_batches_by_hand() -> None:
    from rlhf_batch.core.batching import token_budget_batches

    # longest first: rows 1 (5), 3 (5), 0 (3), 2 (2), 4 (1). Budget 10: rows 1 and 3 pad to
    # 5 x 2 = 10 (exactly the budget: kept together); row 0 would make 5 x 3 = 15 > 10, so a new
    # batch of width 3: 3 x 3 = 9 with rows 2 and 4.
    assert token_budget_batches([3, 5, 2, 5, 1], 10) == [[1, 3], [0, 2, 4]]
    assert token_budget_batches([3, 5, 2, 5, 1], 9) == [[1], [3], [0, 2, 4]]  # 5 x 2 = 10 > 9
    # max_padding 0.3, budget 100: real / padded = 5/5, 10/10, 13/15, 15/20 (padding 0.25), then
    # row 4 would give 16 real of 25 padded: padding 0.36 > 0.3, so it starts a batch
    assert token_budget_batches([3, 5, 2, 5, 1], 100, 0.3) == [[1, 3, 0, 2], [4]]
    assert token_budget_batches([3, 5, 2, 5, 1], 100) == [[1, 3, 0, 2, 4]]
    # a row over the budget gets a batch of its own; empty rows count as width 1
    assert token_budget_batches([20, 3], 10) == [[0], [1]]
    assert token_budget_batches([0, 0], 1) == [[0], [1]]
    assert token_budget_batches([0, 0], 2) == [[0, 1]]
    assert token_budget_batches([], 8) == []
