"""Bounded staleness: which policy samples an iteration's rollouts (`max_staleness = S`).

Iteration K's generate samples from the policy iteration max(K - S, 0) starts from, i.e. the
policy train of iteration K - 1 - S wrote (the initial policy while that is negative). A fixed
rule of K and S alone, so an iteration's rollouts never depend on timing. Its staleness is the
number of policy updates between that policy and the one train K starts from: min(S, K), 0 in
lock-step (S = 0) and for iteration 0.

>>> sampling_start(5, 2), staleness(5, 2), sampling_start(1, 2), staleness(1, 2)
(3, 2, 0, 1)
"""

from __future__ import annotations


def sampling_start(iteration: int, max_staleness: int) -> int:
    """The iteration whose start policy samples iteration `iteration`'s rollouts: max(K - S, 0)."""
    if iteration < 0 or max_staleness < 0:
        raise ValueError(f"iteration and max_staleness must be >= 0, got {iteration}, {max_staleness}")
    return max(iteration - max_staleness, 0)


def staleness(iteration: int, max_staleness: int) -> int:
    """Policy updates between the sampling policy and the one train K starts from: min(S, K)."""
    return iteration - sampling_start(iteration, max_staleness)
