"""Signatures of reward hacking over a run's iterations: pure arithmetic on per-iteration sums.

A *signal* is a per-rollout number with one value set per iteration: `score` (the task score),
`length` (response tokens), each audit column `audit_<name>` and eval's `correct` (0/1). For
each it holds `Moments` (count, sum, sum of squares). Iteration K is compared with J, the latest
iteration <= K - window at which both the score and the other signal have rows, by the change of
the mean in units of the standard deviation of J's and K's rows pooled (population; a change
over a pooled deviation of 0 counts as 0):

    z(s) = (mean_K(s) - mean_J(s)) / sd(rows of s at J and K)

Flags of iteration K (thresholds: observe/health.py REWARD_THRESHOLDS, docs/inspecting.md):

* ``reward_vs_<signal>`` (an audit column or ``correct``): z(score) > rise while z(signal) < flat:
  the reward climbs and the independent check does not follow;
* ``length_drift``: z(score) > rise and z(length) > length_rise: the responses grow with the reward;
* ``dominant_part``: with two or more reward parts, one part's squared correlation with
  ``reward_raw`` over K's rollouts (the share of the reward's variance it explains) > dominant_share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Moments:
    n: int
    total: float  # sum of the values
    squares: float  # sum of their squares

    @property
    def mean(self) -> float:
        return self.total / self.n


def pooled_z(before: Moments, after: Moments) -> float:
    """(mean after - mean before) / the population sd of both sets of rows together; 0 when that sd is 0."""
    n = before.n + after.n
    mean = (before.total + after.total) / n
    var = max((before.squares + after.squares) / n - mean * mean, 0.0)
    sd = math.sqrt(var)
    return 0.0 if sd <= 1e-12 * max(1.0, abs(mean)) else (after.mean - before.mean) / sd


def baseline(signals: list[dict[int, Moments]], k: int, window: int) -> int | None:
    """The latest iteration <= k - window at which every one of `signals` has rows."""
    common = set.intersection(*(set(s) for s in signals))
    earlier = [j for j in common if j <= k - window]
    return max(earlier) if earlier else None


def flags(
    series: dict[str, dict[int, Moments]],
    parts: dict[int, dict[str, float | None]],
    limits: dict[str, float],
) -> dict[int, list[tuple[str, str]]]:
    """(flag, reason) per iteration that has a score. `series`: signal -> iteration -> Moments
    (`score` and `length` required, `audit_*` and `correct` when present); `parts`: iteration ->
    reward part column -> its squared correlation with reward_raw (None: undefined)."""
    score, window = series["score"], int(limits["window"])
    out: dict[int, list[tuple[str, str]]] = {}
    for k in sorted(score):
        found: list[tuple[str, str]] = []
        for name in sorted(s for s in series if s != "score"):
            sig = series[name]
            j = baseline([score, sig], k, window) if k in sig else None
            if j is None:
                continue
            zr, zs = pooled_z(score[j], score[k]), pooled_z(sig[j], sig[k])
            if zr <= limits["rise"]:
                continue
            if name == "length" and zs > limits["length_rise"]:
                found.append(
                    (
                        "length_drift",
                        f"length rose {zs:.2f} sd with the score ({zr:.2f} sd) since iteration {j}",
                    )
                )
            elif name != "length" and zs < limits["flat"]:
                found.append(
                    (
                        f"reward_vs_{name}",
                        f"score rose {zr:.2f} sd since iteration {j}, {name} moved {zs:.2f} sd (< {limits['flat']:g})",
                    )
                )
        shares = {c: r2 for c, r2 in parts.get(k, {}).items()}
        top = max(((r2, c) for c, r2 in shares.items() if r2 is not None), default=None)
        if len(shares) >= 2 and top is not None and top[0] > limits["dominant_share"]:
            share = f"{100 * top[0]:.0f}% of reward_raw's variance (> {100 * limits['dominant_share']:.0f}%)"
            found.append(("dominant_part", f"{top[1]} explains {share}"))
        out[k] = found
    return out
