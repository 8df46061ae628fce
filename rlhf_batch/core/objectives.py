"""The policy objectives beside the clipped token-level PPO surrogate: pure tensor math.

Shapes: ``B`` sequences, ``T`` response positions, ``mask`` a bool ``[B, T]`` of the real tokens;
padding is removed with ``torch.where`` before any ``exp``. docs/stages.md ("train") writes each
formula out with its source.

* ``sequence_log_ratio`` (GSPO, Zheng et al. 2025, arXiv:2507.18071; verl's
  ``compute_policy_loss_gspo``): the sequence's importance ratio is the geometric mean of its
  token ratios, ``s = exp(mean_t(logp - old))``, carried by every token in the "GSPO-token" form
  ``log s_t = sg(log s) + logp_t - sg(logp_t)``: its value is ``log s``, its gradient that of
  ``logp_t``. Clamped at 10 from above as verl clamps it.
* ``cispo_tokens`` (CISPO, MiniMax-M1, arXiv:2506.13585; TRL's ``loss_type="cispo"``):
  ``-sg(min(r, cap)) * A * logp``: the importance weight is truncated and carries no gradient,
  so every token keeps the gradient of its log-prob.
* ``is_weights`` (engine/trainer importance sampling): ``truncate`` ``min(w, cap)`` (TIS), ``mask``
  ``w`` inside ``[low, cap]`` else 0 per token (ICE-POP), ``sequence_mask`` the sequence's product
  ratio ``W = exp(sum_t d_t)`` inside ``[low, cap]`` else 0 for all its tokens (TRL's
  ``vllm_importance_sampling_mode="sequence_mask"``), with ``d = old - behaviour``.
"""

from __future__ import annotations

import torch

RATIO_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo", "cispo")
TIS_MODES = ("truncate", "mask", "sequence_mask")
GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of the GSPO log-ratio, for numerical stability


def sequence_log_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token log-ratio [B, T]: value mean_t(logp - old) of the row, gradient of logp_t."""
    d = torch.where(mask, logp - old, 0.0)  # [B, T]
    seq = d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    log_s = logp - logp.detach() + seq.detach()  # [B, T]
    log_s = torch.where(mask, log_s, 0.0)  # [B, T]
    return torch.clamp(log_s, max=GSPO_LOG_RATIO_MAX)  # [B, T]


def cispo_tokens(
    ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token CISPO loss -sg(min(r, cap)) * A * logp, bool [B, T] where the cap binds)."""
    weight = torch.clamp(ratio, max=cap).detach()  # [B, T]
    logp = torch.where(mask, logp, 0.0)  # [B, T], padding may be -inf
    return -weight * adv * logp, ratio.detach() > cap  # [B, T] each


def is_weights(
    d: torch.Tensor, mask: torch.Tensor, mode: str, low: float, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, T], bool [B, T] of the real tokens masked out) for d = old - behaviour
    (0 on padding). ``truncate`` never masks."""
    if mode == "truncate":
        return torch.clamp(torch.exp(d), max=cap), torch.zeros_like(mask)
    if mode == "mask":
        w = torch.exp(d)  # [B, T]
    elif mode == "sequence_mask":
        w = torch.exp(d.sum(-1, keepdim=True)).expand_as(d)  # [B, T], the row's product ratio
    else:
        raise ValueError(f"unknown tis mode {mode!r}; expected one of {TIS_MODES}")
    keep = (w >= low) & (w <= cap)  # [B, T]
    return torch.where(keep, w, 0.0), mask & ~keep


# one row of train's per-rollout diagnostics (iter=K/train/rollout_stats.parquet), in this order
ROW_STATS = (
    "ratio_mean",  # mean over the row's tokens of the ratio the objective weighs (GSPO: the row's)
    "ratio_max",
    "is_weight",  # mean engine/trainer importance weight applied (1: none; 0 on masked tokens)
    "clipped_tokens",  # tokens where the clip (CISPO: the weight's cap) binds
    "masked_tokens",  # tokens the importance-sampling mask dropped
    "entropy_mean",  # nan: no entropy given
    "logprob_diff_max",  # max |trainer log-prob - behaviour log-prob|
)


def row_stats(
    ratio: torch.Tensor,
    weights: torch.Tensor | None,
    binds: torch.Tensor,
    masked: torch.Tensor,
    entropy: torch.Tensor | None,
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """[B, len(ROW_STATS)] detached per-row statistics over each row's real tokens (a row with
    none: 0, its maxima included)."""
    n = mask.sum(-1).clamp(min=1).to(logp.dtype)  # [B]

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, 0.0).sum(-1) / n  # [B]

    def top(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, float("-inf")).amax(-1).clamp(min=0.0)  # [B], x >= 0 here

    ratio, logp = ratio.detach(), logp.detach()  # [B, T]
    diff = torch.where(mask, logp - behaviour.to(logp.dtype), 0.0).abs()  # [B, T]
    ent = mean(entropy.detach().to(logp.dtype)) if entropy is not None else torch.full_like(n, float("nan"))  # fmt: skip
    cols = [
        mean(ratio),
        top(ratio),
        mean(weights) if weights is not None else torch.ones_like(n),
        (binds & mask).sum(-1),
        (masked & mask).sum(-1),
        ent,
        top(diff),
    ]
    return torch.stack([c.to(logp.dtype) for c in cols], -1)  # [B, 7]
