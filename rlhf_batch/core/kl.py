"""KL penalty math: per-token KL estimators and KL-coefficient (beta) controllers.

Pure math: no I/O, no models. Estimators follow Schulman, "Approximating KL Divergence" (2020),
for ``KL(pi || ref)`` estimated from tokens sampled from ``pi``, with ``logp = log pi(x)`` and
``ref_logp = log ref(x)`` of the sampled token ``x``. Writing ``d = ref_logp - logp``:

* ``k1 = -d = logp - ref_logp``            (unbiased, can be negative)
* ``k2 = 0.5 * d**2``                       (biased, always >= 0)
* ``k3 = exp(d) - d - 1``                   (unbiased, always >= 0)

k3 is bounded as verl's ``low_var_kl`` bounds it: ``d`` is clamped to ``[-K3_LOG_RATIO_CLAMP,
K3_LOG_RATIO_CLAMP]`` (20) before the ``exp`` and the result to ``[0, K3_CLAMP]`` (10). One
token can then add at most 10 to a KL sum or a loss, however far the policy has drifted from
the reference (TRL leaves k3 unbounded: one token at ``d = 10`` adds 22015). Where a clamp binds,
that token's KL gradient is 0. k1 and k2 are not clamped.

Controllers hold the KL coefficient ``beta``. Their state is a plain JSON-serialisable dict
(``state_dict()``), restored with ``controller_from_state``; nothing is pickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
CONTROLLER_KINDS = ("constant", "adaptive")
K3_LOG_RATIO_CLAMP = 20.0  # |ref_logp - logp| clamped to this before the exp (verl's low_var_kl)
K3_CLAMP = 10.0  # k3 per token clamped to [0, K3_CLAMP] (verl's low_var_kl)
ADAPTIVE_ERROR_CLIP = 0.2  # Ziegler et al. 2019 clip the proportional error to [-0.2, 0.2]


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate, same shape as the (equal-shaped) inputs.

    k3 is ``bounded_k3`` (see the module docstring). All three are exactly 0 where
    ``logp == ref_logp``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)} vs ref_logp {tuple(ref_logp.shape)}")
    d = ref_logp - logp  # [...]
    if estimator == "k1":
        return -d  # [...]
    if estimator == "k2":
        return 0.5 * d * d  # [...]
    return bounded_k3(d)  # [...]


def bounded_k3(d: torch.Tensor) -> torch.Tensor:
    """k3 ``exp(d) - d - 1`` of the log-ratio ``d = ref_logp - logp``, bounded: ``d`` clamped to
    ``[-20, 20]``, the result to ``[0, 10]``. Computed as ``expm1(d) - d`` (precise near 0)."""
    d = d.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # [...]
    return (torch.expm1(d) - d).clamp(0.0, K3_CLAMP)  # [...]


def sequence_kl(kl_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of per-token KL ``[B, T]`` over real tokens (``mask`` bool ``[B, T]``) -> ``[B]``.

    Padded positions are ignored even if they hold NaN/inf.
    """
    if kl_tokens.ndim != 2 or kl_tokens.shape != mask.shape:
        raise ValueError(
            f"kl_tokens and mask must both be [B, T]; got {tuple(kl_tokens.shape)} and {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    return torch.where(mask, kl_tokens, 0.0).sum(dim=-1)  # [B]


def kl_shaped_reward(score: torch.Tensor, kl_sum: torch.Tensor, beta: float) -> torch.Tensor:
    """KL-shaped sequence reward ``score - beta * kl_sum`` (``[B]`` each)."""
    return score - beta * kl_sum  # [B]


def _check_beta(beta: float) -> float:
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    return float(beta)


def _check_positive(name: str, x: float | None) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not (math.isfinite(x) and x > 0):
        raise ValueError(f"adaptive KL controller needs a finite {name} > 0, got {x!r}")
    return float(x)


@dataclass
class ConstantKLController:
    """Fixed coefficient: ``value`` stays ``beta`` whatever ``update`` is told."""

    beta: float

    def __post_init__(self) -> None:
        self.beta = _check_beta(self.beta)

    @property
    def value(self) -> float:
        return self.beta

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.beta

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "constant", "beta": self.beta}


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019 proportional controller, steering the observed KL towards ``target``.

    ``update``: ``error = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``beta <- beta * (1 + error * n_steps / horizon)`` (floored at 0, which only matters when
    ``n_steps > 5 * horizon``).
    """

    init_beta: float
    target: float
    horizon: float
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.init_beta = _check_beta(self.init_beta)
        self.target = _check_positive("target", self.target)
        self.horizon = _check_positive("horizon", self.horizon)
        self.value = self.init_beta

    def update(self, current_kl: float, n_steps: int) -> float:
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl!r}")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")
        error = min(max(current_kl / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value = max(self.value * (1.0 + error * n_steps / self.horizon), 0.0)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "adaptive",
            "beta": self.value,
            "init_beta": self.init_beta,
            "target": self.target,
            "horizon": self.horizon,
        }


KLController = ConstantKLController | AdaptiveKLController


def make_controller(
    kind: str, beta: float, target: float | None = None, horizon: float | None = None
) -> KLController:
    """Build a controller; ``target``/``horizon`` are required (> 0) for ``"adaptive"`` and
    ignored for ``"constant"``."""
    if kind == "constant":
        return ConstantKLController(beta)
    if kind == "adaptive":
        return AdaptiveKLController(
            beta, _check_positive("target", target), _check_positive("horizon", horizon)
        )
    raise ValueError(f"unknown KL controller kind {kind!r}; expected one of {CONTROLLER_KINDS}")


def controller_from_state(d: dict[str, Any]) -> KLController:
    """Inverse of ``state_dict()`` (also accepts the dict after a ``json.dumps``/``loads`` trip)."""
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError(f"KL controller state must be a dict with a 'kind' key, got {d!r}")
    kind = d["kind"]
    keys = {"constant": {"kind", "beta"}, "adaptive": {"kind", "beta", "init_beta", "target", "horizon"}}
    if kind not in keys:
        raise ValueError(f"unknown KL controller kind {kind!r}; expected one of {CONTROLLER_KINDS}")
    if set(d) != keys[kind]:
        raise ValueError(f"{kind} KL controller state needs keys {sorted(keys[kind])}, got {sorted(d)}")
    if kind == "constant":
        return ConstantKLController(d["beta"])
    ctl = AdaptiveKLController(d["init_beta"], d["target"], d["horizon"])
    ctl.value = _check_beta(d["beta"])
    return ctl
