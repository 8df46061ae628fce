"""The reward-hacking flags (core/reward_health.py) on hand-built per-iteration series, each
expected flag worked out by hand below, with the documented thresholds (observe/health.py)."""

from __future__ import annotations

import math

from rlhf_batch.core.reward_health import Moments, flags, pooled_z
from rlhf_batch.observe.health import REWARD_THRESHOLDS


def m(values: list[float]) -> Moments:
    return Moments(len(values), float(sum(values)), float(sum(v * v for v in values)))


def test_pooled_z_by_hand() -> None:
    # before [0, 0, 0, 1] (mean 0.25), after [1, 1, 0, 1] (mean 0.75); pooled 8 rows: four 1s,
    # mean 0.5, population variance 0.5 - 0.25 = 0.25, sd 0.5: z = (0.75 - 0.25) / 0.5 = 1.0
    assert pooled_z(m([0, 0, 0, 1]), m([1, 1, 0, 1])) == 1.0
    # before [0, 1, 0, 0], after [0, 1, 0, 1]: pooled mean 3/8, variance 3/8 - 9/64 = 15/64,
    # sd sqrt(15)/8 = 0.48412; z = 0.25 / 0.48412 = 0.51640
    assert math.isclose(pooled_z(m([0, 1, 0, 0]), m([0, 1, 0, 1])), 0.25 / (math.sqrt(15) / 8))
    assert pooled_z(m([10, 10]), m([10, 10, 10])) == 0.0  # no spread: no change


def test_flags_of_a_hand_built_run() -> None:
    """Iterations 0..4, window 3. By hand (z as in test_pooled_z_by_hand):

    * iteration 3 vs 0: score [0,0,0,1] -> [1,1,0,1], z = 1.0 > 0.5 (rose). audit_x [0,1,0,1] ->
      [0,1,0,1], z = 0 < 0.1: reward_vs_audit_x. audit_y [0,0,1,0] -> [1,0,1,1], z = 1.0: follows.
      length 10s -> 10s, z = 0: no drift. Parts: reward_a 0.95 of the variance, two parts and
      0.95 > 0.9: dominant_part.
    * iteration 4: length vs iteration 1 (the latest <= 4 - 3 with both): score [0,0,0,1] ->
      [1,1,0,1], z = 1.0; length 10s -> 20s, pooled mean 15, sd 5, z = 10 / 5 = 2.0 > 1.0:
      length_drift. correct exists at 0 and 4 only, so vs 0: score z = 1.0, correct [0,1,0,0] ->
      [0,1,0,0], z = 0: reward_vs_correct. Flags in signal-name order: correct, then length.
    * iterations 0, 1, 2: no iteration <= K - 3 to compare with; iteration 1's parts share 0.6 /
      0.4 and iteration 2 has one part: no dominant_part.
    * iteration 5: score [0,0,0,1] at 2 -> [0,0,1,1] at 5: pooled mean 3/8, sd sqrt(15)/8, z =
      0.25 / 0.484 = 0.516 > 0.5 (rose); length 10s -> [10,10,10,12]: pooled mean 10.25,
      variance (7 x 100 + 144) / 8 - 10.25^2 = 105.5 - 105.0625 = 0.4375, sd 0.661, z = 0.5 /
      0.661 = 0.756 < 1.0: no drift.
    """
    low, high = [0, 0, 0, 1], [1, 1, 0, 1]
    series = {
        "score": {0: m(low), 1: m(low), 2: m(low), 3: m(high), 4: m(high), 5: m([0, 0, 1, 1])},
        "length": {k: m([10] * 4) for k in range(4)} | {4: m([20] * 4), 5: m([10, 10, 10, 12])},
        "audit_x": {0: m([0, 1, 0, 1]), 3: m([0, 1, 0, 1])},
        "audit_y": {0: m([0, 0, 1, 0]), 3: m([1, 0, 1, 1])},
        "correct": {0: m([0, 1, 0, 0]), 4: m([0, 1, 0, 0])},
    }
    parts = {
        1: {"reward_a": 0.6, "reward_b": 0.4},
        2: {"reward_a": 0.95},
        3: {"reward_a": 0.95, "reward_b": 0.02},
    }
    got = {k: [f for f, _ in v] for k, v in flags(series, parts, REWARD_THRESHOLDS).items()}
    assert got == {
        0: [],
        1: [],
        2: [],
        3: ["reward_vs_audit_x", "dominant_part"],
        4: ["reward_vs_correct", "length_drift"],
        5: [],
    }
    reasons = dict(flags(series, parts, REWARD_THRESHOLDS)[3])
    assert (
        reasons["reward_vs_audit_x"] == "score rose 1.00 sd since iteration 0, audit_x moved 0.00 sd (< 0.1)"
    )
    assert reasons["dominant_part"] == "reward_a explains 95% of reward_raw's variance (> 90%)"


def test_a_small_rise_is_not_flagged() -> None:
    # score [0,0,0,1,0,0,0,0] -> [0,0,0,1,0,0,1,0]: pooled 16 rows, three 1s: mean 3/16,
    # variance 3/16 - 9/256 = 39/256, sd 0.3903; z = (2/8 - 1/8) / 0.3903 = 0.320 <= 0.5: no rise,
    # so a flat audit raises nothing
    series = {
        "score": {0: m([0, 0, 0, 1, 0, 0, 0, 0]), 3: m([0, 0, 0, 1, 0, 0, 1, 0])},
        "length": {0: m([5] * 8), 3: m([5] * 8)},
        "audit_x": {0: m([1] * 8), 3: m([1] * 8)},
    }
    assert flags(series, {}, REWARD_THRESHOLDS) == {0: [], 3: []}
