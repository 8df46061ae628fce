"""Credit per assistant turn (advantage.turn_credit = "to_go"): the per-token advantages of a
multi-turn row from the advantages of its turns.

What turn j of a trajectory earned, r_j, is what the environment said (`turn_rewards`), the last
turn's being the rest of the reward; turn k's return is sum over j >= k of discount^(j - k) r_j
(advantage.turn_discount: 1 credits a turn with everything earned from it on, 0 with its own
r_k alone), normalised among the group's trajectories that reached turn k
(sql/advantage_turns.sql). A turn without a value of its own (None: no other trajectory of its
group reached it, or turn 1 with discount 1, whose return is the whole reward) keeps the
trajectory's advantage. The environment's tokens (not sampled by the policy, loss_mask 0) get 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def turn_token_advantages(
    length: int,
    starts: Sequence[int],
    roles: Sequence[str],
    advantage: float,
    per_turn: Sequence[float | None],
) -> np.ndarray:
    """[length] float32: segment i (from starts[i] to the next start) of role "assistant" gets the
    advantage of its turn (turn k: per_turn[k - 1], or `advantage` where that is None or missing);
    other segments 0.

    >>> turn_token_advantages(7, [0, 2, 4], ["assistant", "user", "assistant"], 0.5, [None, -1.0]).tolist()
    [0.5, 0.5, 0.0, 0.0, -1.0, -1.0, -1.0]
    """
    out = np.zeros(length, dtype=np.float32)  # [T]
    ends = [*starts[1:], length]
    turn = 0
    for start, end, role in zip(starts, ends, roles, strict=True):
        if role != "assistant":
            continue
        value = per_turn[turn] if turn < len(per_turn) else None
        out[start:end] = advantage if value is None else value
        turn += 1
    return out
