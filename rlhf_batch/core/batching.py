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


def aligned_chunks(
    rows_a: Sequence[int], rows_b: Sequence[int], max_chunks: int
) -> list[tuple[range, range]]:
    """Two lists of parts that hold the same rows in the same order (row counts `rows_a`,
    `rows_b`, cut differently) in at most `max_chunks` chunks of roughly equal rows.

    A chunk is (range of a's parts, range of b's parts) whose rows are the same rows of the
    sequence: chunks are cut only where both lists have a part boundary at the same row. When
    the totals differ, the last chunk takes all parts after the last common boundary.
    """
    total = sum(rows_a)
    cuts = [(0, 0)]  # (i, j): a[:i] and b[:j] hold the same number of rows
    i = j = held_a = held_b = 0
    while i < len(rows_a) or j < len(rows_b):
        if j == len(rows_b) or (i < len(rows_a) and held_a <= held_b):
            held_a, i = held_a + rows_a[i], i + 1
        else:
            held_b, j = held_b + rows_b[j], j + 1
        if held_a == held_b > 0 and held_a >= total * len(cuts) / max(max_chunks, 1):
            cuts.append((i, j))
    if cuts[-1] != (len(rows_a), len(rows_b)):
        if len(cuts) > max(max_chunks, 1):
            cuts.pop()
        cuts.append((len(rows_a), len(rows_b)))
    return [(range(a0, a1), range(b0, b1)) for (a0, b0), (a1, b1) in zip(cuts, cuts[1:], strict=False)]
