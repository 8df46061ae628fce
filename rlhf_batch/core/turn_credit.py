"""Credit per assistant turn (advantage.turn_credit = "to_go"): the per-token advantages of a
multi-turn row from its trajectory advantage and the advantages of its later turns.

A trajectory's assistant turn k (1, 2, ...) is credited with what the trajectory earned from that
turn on: its reward minus the `turn_rewards` of turns 1..k-1, normalised among the group's
trajectories that reached turn k (sql/advantage_turns.sql). Turn 1's is the trajectory's own
advantage (its return is the whole reward). A turn no other trajectory of its group reached has
no baseline of its own (None) and keeps the trajectory's advantage. The environment's tokens
(not sampled by the policy, loss_mask 0) get 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def turn_token_advantages(
    length: int,
    starts: Sequence[int],
    roles: Sequence[str],
    advantage: float,
    later: Sequence[float | None],
) -> np.ndarray:
    """[length] float32: segment i (from starts[i] to the next start) of role "assistant" gets the
    advantage of its turn (the first: `advantage`; turn k >= 2: later[k - 2], or `advantage`
    where that is None or missing); other segments 0.

    >>> turn_token_advantages(7, [0, 2, 4], ["assistant", "user", "assistant"], 0.5, [-1.0]).tolist()
    [0.5, 0.5, 0.0, 0.0, -1.0, -1.0, -1.0]
    """
    out = np.zeros(length, dtype=np.float32)  # [T]
    ends = [*starts[1:], length]
    turn = 0
    for start, end, role in zip(starts, ends, roles, strict=True):
        if role != "assistant":
            continue
        value = later[turn - 1] if 0 < turn <= len(later) else None
        out[start:end] = advantage if value is None else value
        turn += 1
    return out
