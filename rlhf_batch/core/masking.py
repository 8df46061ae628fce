"""Loss masks of multi-turn trajectories: which response tokens the policy sampled.

A multi-turn rollout's response interleaves tokens the policy sampled (loss_mask 1) and tokens the
environment inserted (tool results, user turns, the chat template's glue: loss_mask 0). Every
statistic that trains or measures the policy counts only the sampled tokens: the KL of score,
train's loss, KL, entropy, clip and ESS statistics and its token normaliser. A rollout without a
mask (single-turn, `mask` None here) is all ones, and each function then returns its input
unchanged, so single-turn numbers stay bit-identical.

Shapes: ``N`` flat response tokens of ``B`` rows, row i holding ``lengths[i]`` of them; ``T``
the longest row (right-padded ``[B, T]`` layouts).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def zero_unsampled(values: Any, mask: np.ndarray | None) -> Any:
    """Flat per-token values [N] (a torch tensor) with 0.0 where the policy did not sample
    (`mask` [N] bool; None: unchanged)."""
    import torch

    if mask is None:
        return values
    if mask.shape != tuple(values.shape):
        raise ValueError(f"mask {mask.shape} and values {tuple(values.shape)} must both be [N]")
    return torch.where(torch.from_numpy(mask), values, 0.0)  # [N]


def sampled_lengths(mask: np.ndarray | None, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[B] the sampled tokens of each row (`offsets` [B + 1] into the flat `mask`); `lengths`
    itself without a mask."""
    if mask is None:
        return lengths
    ends = np.concatenate([[0], np.cumsum(mask.astype(np.int64))])  # [N + 1]
    out: np.ndarray = (ends[offsets[1:]] - ends[offsets[:-1]]).astype(lengths.dtype)  # [B]
    return out


def padded_rows(mask: np.ndarray, offsets: np.ndarray, rows: list[int], width: int) -> np.ndarray:
    """[B, width] bool: rows `rows` of the flat `mask`, right-padded with False."""
    out = np.zeros((len(rows), width), dtype=bool)  # [B, T]
    for k, i in enumerate(rows):
        row = mask[offsets[i] : offsets[i + 1]]
        out[k, : len(row)] = row
    return out


def check_mask(mask: list[int], n_tokens: int, logprobs: list[float]) -> str | None:
    """What is wrong with one row's loss mask (None: nothing): one 0/1 per response token, and a
    behaviour log-prob of 0.0 where it is 0."""
    if len(mask) != n_tokens:
        return f"has {len(mask)} values for {n_tokens} response tokens"
    if any(m not in (0, 1) for m in mask):
        return "holds a value other than 0 and 1"
    if any(m == 0 and lp != 0.0 for m, lp in zip(mask, logprobs, strict=True)):
        return "is 0 on a token whose behavior_logprobs value is not 0.0"
    return None
