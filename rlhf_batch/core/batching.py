"""Token-budget batching on sequence lengths (pure: lengths in, row indices out)."""

from __future__ import annotations

from collections.abc import Sequence


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices in batches whose padded size (rows x longest row) stays within `max_tokens`.

    Rows are taken longest first, so each batch holds rows of similar length and padding is a
    small share of the work; a row longer than the budget gets a batch of its own. The caller
    restores the input order from the indices.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        width = max(longest, lengths[i], 1)
        if current and width * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, width = [], max(lengths[i], 1)
        current.append(i)
        longest = width
    if current:
        batches.append(current)
    return batches
