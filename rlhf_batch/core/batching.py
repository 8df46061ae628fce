"""Token-budget batching on sequence lengths (pure: lengths in, row indices out)."""

from __future__ import annotations

from collections.abc import Sequence


def token_budget_batches(
    lengths: Sequence[int], max_tokens: int, max_padding: float = 1.0
) -> list[list[int]]:
    """Row indices in batches whose padded size (rows x longest row) stays within `max_tokens`.

    Rows are taken longest first, so each batch holds rows of similar length and padding is a
    small share of the work; a row longer than the budget gets a batch of its own. With
    `max_padding` < 1 a batch is also closed before its padding (1 - real tokens / padded
    tokens) would exceed that share. The caller restores the input order from the indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = real = 0
    for i in order:
        width = max(longest, lengths[i], 1)
        padded = width * (len(current) + 1)
        if current and (padded > max_tokens or real + lengths[i] < (1.0 - max_padding) * padded):
            batches.append(current)
            current, width, real = [], max(lengths[i], 1), 0
        current.append(i)
        longest = width
        real += lengths[i]
    if current:
        batches.append(current)
    return batches
