import numpy as np
import pytest
import torch

from rlhf_batch.core.masking import check_mask, padded_rows, sampled_lengths, zero_unsampled


def test_zero_unsampled_keeps_sampled_values_and_none_is_identity() -> None:
    kl = torch.tensor([0.5, -0.25, 2.0, 1.0], dtype=torch.float64)
    mask = np.array([True, False, True, False])
    assert zero_unsampled(kl, mask).tolist() == [0.5, 0.0, 2.0, 0.0]  # env tokens -> 0
    assert zero_unsampled(kl, None) is kl  # no mask: the single-turn tensor itself
    with pytest.raises(ValueError, match=r"\[N\]"):
        zero_unsampled(kl, mask[:3])


def test_sampled_lengths_count_ones_per_row() -> None:
    # rows of 3, 0 and 4 tokens; masks 1 0 1 | - | 0 0 1 1 -> 2, 0, 2 sampled tokens
    mask = np.array([1, 0, 1, 0, 0, 1, 1], bool)
    offsets, lengths = np.array([0, 3, 3, 7]), np.array([3, 0, 4])
    assert sampled_lengths(mask, offsets, lengths).tolist() == [2, 0, 2]
    assert sampled_lengths(None, offsets, lengths) is lengths


def test_padded_rows_right_pads_with_false() -> None:
    mask = np.array([1, 0, 1, 0, 0, 1, 1], bool)
    offsets = np.array([0, 3, 3, 7])
    out = padded_rows(mask, offsets, [2, 0], 5)
    assert out.tolist() == [[False, False, True, True, False], [True, False, True, False, False]]


def test_check_mask_names_each_problem() -> None:
    assert check_mask([1, 0, 1], 3, [-1.0, 0.0, -2.0]) is None
    assert "2 values for 3" in check_mask([1, 0], 3, [-1.0, 0.0, -2.0])
    assert "other than 0 and 1" in check_mask([1, 2, 1], 3, [-1.0, 0.0, -2.0])
    assert "not 0.0" in check_mask([1, 0, 1], 3, [-1.0, -0.5, -2.0])


def test_flat_mask_reads_the_column_and_names_a_bad_row() -> None:
    import pyarrow as pa

    from rlhf_batch.errors import StageError
    from rlhf_batch.stages.loss_mask import flat_mask

    ids = ["r0", "r1"]
    lengths = np.array([3, 2])
    col = lambda rows: pa.table({"rollout_id": ids, "loss_mask": pa.array(rows, pa.list_(pa.int8()))})  # noqa: E731
    assert flat_mask(pa.table({"rollout_id": ids}), lengths) is None  # single-turn
    assert flat_mask(col([[1, 1, 1], None]), lengths) is None  # all ones (null: ones)
    assert flat_mask(col([[1, 0, 1], None]), lengths).tolist() == [True, False, True, True, True]
    with pytest.raises(
        StageError, match=r"^rollout r1: column 'loss_mask' has 3 values for 2 response tokens$"
    ):
        flat_mask(col([[1, 1, 1], [1, 1, 1]]), lengths)
    with pytest.raises(
        StageError, match=r"^rollout r0: column 'loss_mask' holds a value other than 0 and 1$"
    ):
        flat_mask(col([[1, 2, 1], [1, 1]]), lengths)
