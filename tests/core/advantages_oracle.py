"""The test oracle of the advantage SQL: group-relative advantage estimators (GRPO, Dr. GRPO, RLOO)
over a flat batch of rewards, in torch.

Pure math: no I/O, no models, no autograd (inputs are detached). Everything is computed in
float64 and vectorised over groups (``torch.unique`` + ``bincount``/``scatter_reduce``); there
is no Python loop over groups. A DuckDB SQL twin must follow exactly these semantics.

Notation, per group ``g`` and counting only *non-null* rewards of ``g``:
``n_g`` = count, ``mean_g`` = sum / n_g, ``std_g = sqrt(sum (r - mean_g)^2 / (n_g - ddof))``
(``ddof=1``: sample std, SQL ``stddev_samp``; ``ddof=0``: population std, ``stddev_pop``).

* ``grpo``   : ``adv = (r - mean_g) / (s + eps)`` where ``s`` depends on ``scale``:
  ``"group"`` -> ``std_g``; ``"batch"`` -> the std (same ``ddof``) of *all non-null rewards of
  the batch* around the *batch* mean (not pooled within-group); ``"none"`` -> no division
  (``adv = r - mean_g``, eps unused). eps is added to the std, never inside the sqrt.
* ``drgrpo`` : ``adv = r - mean_g``.
* ``rloo``   : ``adv = r_i - (sum_{j != i} r_j) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g)``;
  for a group of two this is ``r_i - r_j``.
  ``scale``, ``ddof`` and ``eps`` only affect ``grpo`` (``scale`` is still validated).

Special cases, identical for every estimator:

* Null rewards: ``NaN`` in ``rewards`` means "no reward". Such rows are left out of every
  statistic (group and batch) and get ``NaN`` advantage. Null rows do not count in ``n_g``.
* Constant groups (``max == min`` over the non-null rewards, which includes groups of one):
  ``mean_g`` is set to that common value and ``std_g`` to 0, and every advantage of the group is
  *exactly* ``0.0``. This avoids float noise such as ``(0.7 - mean([0.7]*k)) / (tiny + eps)``
  being non-zero, and makes ``n_g = 1`` with ``ddof = 1`` well defined (no 0/0).
* ``+/-inf`` rewards are rejected (ValueError); only finite values and NaN are allowed.

The result has the dtype of ``rewards`` if it is floating point, else float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ESTIMATORS = ("grpo", "drgrpo", "rloo")
SCALES = ("group", "batch", "none")

GroupIds = torch.Tensor | Sequence[str] | Sequence[int]
F64 = torch.float64


def _as_rewards(rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Validate ``rewards`` and return them detached as float64 ``[N]`` (never modified in place)."""
    r = rewards if isinstance(rewards, torch.Tensor) else torch.as_tensor(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a 1-D tensor, got shape {tuple(r.shape)}")
    if r.is_complex():
        raise ValueError("rewards must be real-valued, got a complex tensor")
    r = r.detach().to(F64)  # [N]
    if bool(torch.isinf(r).any()):
        raise ValueError("rewards must be finite or NaN (null); got +/-inf")
    return r


def _group_index(group_ids: GroupIds, n: int) -> tuple[torch.Tensor, int]:
    """Map ``group_ids`` to a dense int64 index in ``[0, G)`` per row; return ``(index, G)``."""
    if isinstance(group_ids, torch.Tensor):
        ids = group_ids.detach()
        if ids.dtype.is_floating_point or ids.is_complex():
            raise ValueError(f"group_ids tensor must have an integer dtype, got {ids.dtype}")
    else:
        arr = np.asarray(group_ids)
        if arr.ndim != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind in "US":  # strings: dense codes via a sort
            arr = np.unique(arr, return_inverse=True)[1].reshape(-1)
        elif arr.size == 0:
            arr = np.zeros(0, dtype=np.int64)
        elif arr.dtype.kind not in "iub":
            raise ValueError(f"group_ids must be all str or all int, got numpy dtype {arr.dtype}")
        ids = torch.from_numpy(arr.astype(np.int64))
    if ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.shape[0] != n:
        raise ValueError(f"length mismatch: {n} rewards but {ids.shape[0]} group_ids")
    uniq, inv = torch.unique(ids, return_inverse=True)  # [G], [N]
    return inv.to(torch.int64), int(uniq.numel())


def _check_ddof(ddof: int) -> None:
    if ddof not in (0, 1) or isinstance(ddof, bool):
        raise ValueError(f"ddof must be 0 (population std) or 1 (sample std), got {ddof!r}")


def _select(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x[valid]``, skipping the copy when every row is valid (the common case)."""
    return x if bool(valid.all()) else x[valid]


def _stats(
    r: torch.Tensor, valid: torch.Tensor, inv: torch.Tensor, n_groups: int, ddof: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group ``(count, mean, std, constant)``, each ``[G]``, over non-null rewards.

    Empty groups (all rewards null) get ``mean = std = NaN`` and ``constant = False``.
    """
    rv, iv = _select(r, valid), _select(inv, valid)  # [Nv], [Nv]
    count = torch.bincount(iv, minlength=n_groups)  # [G]
    total = torch.bincount(iv, weights=rv, minlength=n_groups).to(F64)  # [G]; int64 if empty
    lo = torch.full((n_groups,), float("inf"), dtype=F64).scatter_reduce_(0, iv, rv, "amin")  # [G]
    hi = torch.full((n_groups,), float("-inf"), dtype=F64).scatter_reduce_(0, iv, rv, "amax")  # [G]
    constant = (count > 0) & (lo == hi)  # [G]
    mean = torch.where(constant, lo, total / count)  # [G]; 0/0 -> NaN for empty groups
    dev = rv - mean[iv]  # [Nv]
    ss = torch.bincount(iv, weights=dev * dev, minlength=n_groups).to(F64)  # [G]
    std = torch.sqrt(ss / (count - ddof).clamp_min(1))  # [G]; non-constant => count >= 2
    std = torch.where(constant, 0.0, std)  # [G]
    std = torch.where(count == 0, float("nan"), std)  # [G]
    return count, mean, std, constant


def _batch_std(rv: torch.Tensor, ddof: int) -> float:
    """Std (given ddof) of all non-null rewards ``rv`` ``[Nv]`` around the batch mean; 0 if constant."""
    if rv.numel() <= ddof or bool(rv.min() == rv.max()):
        return 0.0
    dev = rv - rv.mean()  # [Nv]
    return float(torch.sqrt((dev * dev).sum() / (rv.numel() - ddof)))


def group_stats(
    rewards: torch.Tensor | Sequence[float], group_ids: GroupIds, ddof: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(size, mean, std)`` of the row's group, over the group's non-null rewards.

    ``size`` is int64 (count of non-null rewards in the group); ``mean`` and ``std`` are float64.
    A null row still reports its group's statistics. Constant groups (incl. size 1) have
    ``std == 0.0`` exactly and ``mean`` equal to the common value; all-null groups have
    ``size 0`` and NaN mean/std.
    """
    _check_ddof(ddof)
    r = _as_rewards(rewards)  # [N]
    inv, n_groups = _group_index(group_ids, r.shape[0])  # [N]
    count, mean, std, _ = _stats(r, ~torch.isnan(r), inv, n_groups, ddof)  # [G] x3
    return count[inv], mean[inv], std[inv]  # [N] x3


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: GroupIds,
    *,
    estimator: str = "grpo",
    scale: str = "group",
    ddof: int = 1,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages ``[N]``; see the module docstring for the exact semantics.

    Args:
        rewards: ``[N]`` real rewards; NaN marks a null reward (excluded, advantage NaN).
        group_ids: ``[N]`` integer tensor, or a sequence of str (or int), one per row.
        estimator: ``"grpo"``, ``"drgrpo"`` or ``"rloo"``.
        scale: grpo only: divide by the ``"group"`` std, the ``"batch"`` std, or ``"none"``.
        ddof: 1 for the sample std, 0 for the population std (grpo only).
        eps: ``>= 0``, added to the std in the grpo denominator.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {SCALES}")
    _check_ddof(ddof)
    if not (eps >= 0 and np.isfinite(eps)):
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    out_dtype = rewards.dtype if isinstance(rewards, torch.Tensor) and rewards.is_floating_point() else F64
    r = _as_rewards(rewards)  # [N]
    inv, n_groups = _group_index(group_ids, r.shape[0])  # [N]
    valid = ~torch.isnan(r)  # [N]
    count, mean, std, constant = _stats(r, valid, inv, n_groups, ddof)  # [G] x4
    rv, iv = _select(r, valid), _select(inv, valid)  # [Nv], [Nv]
    centred = rv - mean[iv]  # [Nv]

    if estimator == "drgrpo" or (estimator == "grpo" and scale == "none"):
        adv = centred  # [Nv]
    elif estimator == "grpo":
        denom = std[iv] if scale == "group" else torch.full_like(rv, _batch_std(rv, ddof))  # [Nv]
        adv = centred / (denom + eps)  # [Nv]
    else:  # rloo: n / (n - 1) * (r - mean); n == 1 is a constant group, handled below
        n = count[iv].to(F64)  # [Nv]
        adv = centred * n / (n - 1).clamp_min(1.0)  # [Nv]

    adv = torch.where(constant[iv], 0.0, adv)  # [Nv]; exact zeros for constant groups
    if adv.shape[0] == r.shape[0]:  # no null rewards
        return adv.to(out_dtype)  # [N]
    out = torch.full_like(r, float("nan"))  # [N]
    out[valid] = adv
    return out.to(out_dtype)  # [N]
