"""rlhf_batch.core.staleness: which policy samples an iteration (max_staleness), by hand."""

from __future__ import annotations

import pytest

from rlhf_batch.core.staleness import sampling_start, staleness


def test_sampling_start_and_staleness_by_hand() -> None:
    # K - S, floored at 0; staleness K - start = min(S, K)
    assert [sampling_start(k, 2) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [staleness(k, 2) for k in range(5)] == [0, 1, 2, 2, 2]
    assert [sampling_start(k, 0) for k in range(3)] == [0, 1, 2] and staleness(7, 0) == 0
    for bad in ((-1, 0), (0, -1)):
        with pytest.raises(ValueError, match="must be >= 0"):
            sampling_start(*bad)
