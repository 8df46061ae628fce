"""GRPO policy loss: pure tensor math (no I/O, no models).

Shapes: ``B`` sequences, ``T`` response positions. ``mask`` is a bool ``[B, T]`` built from
lengths (never from token values); positions where it is False are padding and may hold any
value, including inf/nan: they are removed with ``torch.where`` *before* any ``exp``, so they
change neither the loss nor its gradient.

Precision: the math runs in the dtype of ``logprobs``; bf16/fp16 inputs are upcast to float32
(the train stage already passes float32 log-probs).

Aggregation (the same one is applied to every loss term):

* ``token_mean``: sum over real tokens / number of real tokens.
* ``seq_mean_token_mean`` (GRPO paper): mean over each sequence's real tokens, then mean
  over sequences.
* ``seq_mean_token_sum_norm`` (Dr. GRPO): each sequence's token sum / ``norm_const``, then
  mean over sequences.

"Number of sequences" counts only rows with at least one real token; an all-padding row
contributes nothing. ``denominator`` replaces the local count (real tokens for ``token_mean``,
sequences for the ``seq_mean_*`` variants) with the count over the whole optimizer step on all
ranks, so that summing the micro-batch losses gives exactly the big-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorClass

from rlhf_batch.core.kl import bounded_k3
from rlhf_batch.core.objectives import (
    LOSS_TYPES,
    RATIO_LEVELS,
    TIS_MODES,
    cispo_tokens,
    is_weights,
    row_stats,
    sequence_log_ratio,
)

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


class GRPOLossOutput(TensorClass):
    """Scalar results (``batch_size`` is ``[]``, the default when none is given).

    ``loss*`` fields keep the autograd graph; metrics are detached.

    Metrics are local to the call (not divided by ``denominator``) and are 0.0 when there is
    nothing to report (no real tokens, no ``ref_logprobs``, no ``entropy``).
    """

    loss: torch.Tensor  # objective + kl_to_ref + kl_to_inference + entropy terms
    loss_objective: torch.Tensor  # clipped surrogate
    loss_kl_to_ref: torch.Tensor  # kl_coef * agg(k3(logp, ref))
    loss_kl_to_inference: torch.Tensor  # kl_to_inference_coef * agg(k3(logp, old))
    loss_entropy: torch.Tensor  # -entropy_coef * agg(entropy)
    clip_fraction: torch.Tensor  # share of real tokens where the PPO clip binds
    kl_approx: torch.Tensor  # masked mean of r - 1 - log r: k3 of KL(behaviour || current)
    kl_to_ref: torch.Tensor  # masked mean of k3(logp, ref)
    entropy: torch.Tensor  # masked mean of entropy
    ratio_mean: torch.Tensor  # masked mean of the token ratio (of the sequence ratio: ratio_level "sequence")
    tis_masked: torch.Tensor  # share of real tokens the importance-sampling mask drops (tis_mode mask modes)
    row_stats: torch.Tensor  # [B, len(objectives.ROW_STATS)] per-row diagnostics (objectives.row_stats)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ``mask`` (padding values, even nan/inf, are ignored)."""
    return torch.where(mask, x, 0.0).sum()  # []


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0.0 when the mask is empty."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1)  # []


def k3(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``exp(ref - logp) - (ref - logp) - 1``, 0 on padding, bounded as
    ``core.kl.bounded_k3`` bounds it (log-ratio clamped to +-20, value to [0, 10])."""
    d = torch.where(mask, ref - logp, 0.0)  # [B, T], masked before exp
    return bounded_k3(d)  # [B, T]


def _aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    norm_const: float | None,
    denominator: float | torch.Tensor | None,
) -> torch.Tensor:
    """Reduce per-token values ``x`` [B, T] to a scalar with the chosen aggregation."""
    x = torch.where(mask, x, 0.0)  # [B, T]
    if aggregation == "token_mean":
        total, count = x.sum(), mask.sum()  # [], []
    else:
        lengths = mask.sum(-1)  # [B]
        if aggregation == "seq_mean_token_mean":
            per_seq = x.sum(-1) / lengths.clamp(min=1)  # [B]
        else:
            assert norm_const is not None
            per_seq = x.sum(-1) / norm_const  # [B]
        total, count = per_seq.sum(), (lengths > 0).sum()  # [], []
    return total / (count.clamp(min=1) if denominator is None else denominator)  # []


def _validate(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    norm_const: float | None,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    denominator: float | torch.Tensor | None,
) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if aggregation == "seq_mean_token_sum_norm" and (norm_const is None or norm_const <= 0):
        raise ValueError(f"aggregation 'seq_mean_token_sum_norm' needs norm_const > 0, got {norm_const}")
    if mask.dtype != torch.bool or mask.shape != logprobs.shape or logprobs.dim() != 2:
        raise ValueError(f"mask must be bool [B, T] like logprobs {tuple(logprobs.shape)}")
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low/eps_high must be >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    # a number is checked on the host; a tensor (on a device: a host sync) only when one is passed
    if denominator is not None and not (
        bool(denominator > 0) if isinstance(denominator, torch.Tensor) else denominator > 0
    ):
        raise ValueError(f"denominator must be > 0, got {denominator}")


def _penalties(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    agg: Callable[[torch.Tensor], torch.Tensor],
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    kl_to_inference_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
) -> tuple[torch.Tensor, ...]:
    """(loss_kl_to_ref, kl_to_ref, loss_kl_to_inference, loss_entropy, entropy metric), each []."""
    dtype = logprobs.dtype
    zero = logprobs.new_zeros(())  # []
    loss_kl_to_ref, kl_to_ref = zero, zero
    if ref_logprobs is not None:
        kl_ref_tok = k3(logprobs, ref_logprobs.detach().to(dtype), mask)  # [B, T]
        kl_to_ref = masked_mean(kl_ref_tok, mask).detach()  # []
        if kl_coef != 0.0:
            loss_kl_to_ref = kl_coef * agg(kl_ref_tok)  # []
    loss_kl_to_inference = zero
    if kl_to_inference_coef != 0.0:
        loss_kl_to_inference = kl_to_inference_coef * agg(k3(logprobs, old, mask))  # []
    loss_entropy, entropy_metric = zero, zero
    if entropy is not None:
        ent = entropy.to(dtype)  # [B, T]
        entropy_metric = masked_mean(ent, mask).detach()  # []
        if entropy_coef != 0.0:
            loss_entropy = -entropy_coef * agg(ent)  # []

    return loss_kl_to_ref, kl_to_ref, loss_kl_to_inference, loss_entropy, entropy_metric


def _validate_terms(
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
    behavior_logprobs: torch.Tensor | None,
    tis_cap: float,
) -> None:
    """Each optional term of the loss has the tensor it needs."""
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if tis_cap < 0 or (tis_cap > 0 and behavior_logprobs is None):
        raise ValueError(f"tis_cap must be >= 0 and > 0 needs behavior_logprobs, got {tis_cap}")


def _validate_objective(ratio_level: str, loss_type: str, tis_mode: str, cispo_max: float) -> None:
    """The objective's names are known (config.py turns bad combinations into one-line errors)."""
    for value, known in ((ratio_level, RATIO_LEVELS), (loss_type, LOSS_TYPES), (tis_mode, TIS_MODES)):
        if value not in known:
            raise ValueError(f"unknown {value!r}; expected one of {known}")
    if loss_type == "cispo" and not cispo_max > 0:
        raise ValueError(f"cispo_max must be > 0, got {cispo_max}")


def _clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> torch.Tensor:
    """Per token: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with the dual clip for A < 0."""
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    loss_tok = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    if dual_clip is not None:
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, -dual_clip * adv), loss_tok)  # [B, T]
    return loss_tok


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    norm_const: float | None = None,
    kl_to_inference_coef: float = 0.0,
    denominator: float | torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    tis_cap: float = 0.0,
    ratio_level: str = "token",
    loss_type: str = "ppo",
    cispo_max: float = 5.0,
    tis_mode: str = "truncate",
    tis_low: float = 0.0,
) -> GRPOLossOutput:
    """Clipped GRPO/PPO surrogate with optional dual clip, KL terms and entropy bonus.

    Per real token, with ``r = exp(logp - old)``::

        loss_tok = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
        if dual_clip is c and A < 0: loss_tok = min(loss_tok, -c * A)

    ``clip_fraction`` counts tokens where the clip binds, i.e. where the min picks the clipped
    term and it differs from the unclipped one: ``A > 0 and r > 1 + eps_high`` or
    ``A < 0 and r < 1 - eps_low`` (these tokens get zero gradient from the objective).
    ``A > 0, r < 1 - eps_low`` and ``A < 0, r > 1 + eps_high`` are not clipped (the min keeps
    the unclipped term); ``A == 0`` never binds; the dual clip is not counted.

    Truncated importance sampling (``tis_cap > 0``, as TRL's ``vllm_importance_sampling_correction``):
    when the rollouts were sampled by another engine, ``old_logprobs`` are the trainer's own
    log-probs of them (recomputed) and ``behavior_logprobs`` the engine's; each token's objective
    term is multiplied by the constant ``min(exp(old - behavior), tis_cap)``, before the KL and
    entropy terms are added. With stale rollouts (``max_staleness`` > 0) the same two inputs make
    AReaL's decoupled PPO objective: ``old`` is the proximal anchor (the policy train starts
    from), ``behavior_logprobs`` the older policy that sampled the rows.

    ``tis_mode`` "mask" / "sequence_mask" replace the truncation by a band ``[tis_low, tis_cap]``:
    tokens (or whole rows, by their product ratio) outside it get weight 0 (``core.objectives``).
    ``ratio_level="sequence"`` (GSPO) replaces ``r`` by the row's geometric-mean ratio;
    ``loss_type="cispo"`` replaces the clipped surrogate by ``-sg(min(r, cispo_max)) * A * logp``
    (``clip_fraction`` then counts the tokens whose weight is truncated).
    """
    eps_high = eps_low if eps_high is None else eps_high
    _validate(logprobs, mask, aggregation, norm_const, eps_low, eps_high, dual_clip, denominator)
    _validate_terms(ref_logprobs, kl_coef, entropy, entropy_coef, behavior_logprobs, tis_cap)
    _validate_objective(ratio_level, loss_type, tis_mode, cispo_max)
    if logprobs.dtype in (torch.bfloat16, torch.float16):
        logprobs = logprobs.float()  # [B, T]
    dtype = logprobs.dtype
    old = old_logprobs.detach().to(dtype)  # [B, T]
    adv = advantages.detach().to(dtype)  # [B] or [B, T]
    adv = torch.where(mask, adv.unsqueeze(-1) if adv.dim() == 1 else adv, 0.0)  # [B, T]

    def agg(x: torch.Tensor) -> torch.Tensor:
        return _aggregate(x, mask, aggregation, norm_const, denominator)  # []

    log_ratio = torch.where(mask, logprobs - old, 0.0)  # [B, T], masked before exp
    ratio = torch.exp(log_ratio)  # [B, T]
    # the ratio the objective weighs: the token's, or its row's (GSPO)
    obj_ratio = (
        ratio if ratio_level == "token" else torch.exp(sequence_log_ratio(logprobs, old, mask))
    )  # [B, T]
    if loss_type == "cispo":
        loss_tok, binds = cispo_tokens(obj_ratio, logprobs, adv, mask, cispo_max)  # [B, T] each
    else:
        loss_tok = _clipped_objective(obj_ratio, adv, eps_low, eps_high, dual_clip)  # [B, T]
    masked = torch.zeros_like(mask)  # [B, T]
    weights: torch.Tensor | None = None  # [B, T] when importance sampling weighs the tokens
    if tis_cap > 0:
        assert behavior_logprobs is not None
        d = torch.where(mask, old - behavior_logprobs.detach().to(dtype), 0.0)  # [B, T], masked before exp
        weights, masked = is_weights(d, mask, tis_mode, tis_low, tis_cap)  # [B, T] each
        loss_tok = loss_tok * weights  # [B, T]
    loss_objective = agg(loss_tok)  # []

    loss_kl_to_ref, kl_to_ref, loss_kl_to_inference, loss_entropy, entropy_metric = _penalties(
        logprobs, old, mask, agg, ref_logprobs, kl_coef, kl_to_inference_coef, entropy, entropy_coef
    )
    loss = loss_objective + loss_kl_to_ref + loss_kl_to_inference + loss_entropy  # []
    ratio, log_ratio, obj_ratio = (
        ratio.detach(),
        log_ratio.detach(),
        obj_ratio.detach(),
    )  # [B, T], metrics only
    if loss_type == "ppo":
        binds = ((adv > 0) & (obj_ratio > 1.0 + eps_high)) | (
            (adv < 0) & (obj_ratio < 1.0 - eps_low)
        )  # [B, T]
    return GRPOLossOutput(
        loss=loss,
        loss_objective=loss_objective,
        loss_kl_to_ref=loss_kl_to_ref,
        loss_kl_to_inference=loss_kl_to_inference,
        loss_entropy=loss_entropy,
        clip_fraction=masked_mean(binds.to(dtype), mask),
        kl_approx=masked_mean(ratio - 1.0 - log_ratio, mask),
        kl_to_ref=kl_to_ref,
        entropy=entropy_metric,
        ratio_mean=masked_mean(obj_ratio, mask),
        tis_masked=masked_mean(masked.to(dtype), mask),
        row_stats=row_stats(
            obj_ratio,
            weights,
            binds,
            masked,
            entropy,
            logprobs,
            old if behavior_logprobs is None else behavior_logprobs.detach(),
            mask,
        ),
    )
