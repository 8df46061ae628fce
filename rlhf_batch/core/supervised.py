"""The objectives that learn from chosen stored rollouts, with no importance ratio: pure tensor
math (no I/O, no models).

Shapes and masks as in core/losses.py: ``B`` rows, ``T`` response positions, ``mask`` a bool
``[B, T]`` of the tokens trained on (the sampled ones: on multi-turn rows the environment's
tokens are False), padding removed with ``torch.where`` before any sum.

* ``sft_loss`` (rejection-sampling SFT, expert iteration): the token cross-entropy
  ``-sum(logp over mask) / denominator``, ``denominator`` the trained tokens of the whole
  optimizer step (TRL's ``SFTTrainer`` with ``completion_only_loss``: the mean over the batch's
  completion tokens).
* ``preference_losses`` / ``dpo_loss`` (DPO, Rafailov et al. 2023; IPO, Azar et al. 2023), as TRL's
  ``DPOTrainer._compute_loss`` computes them with ``f_divergence_type = "reverse_kl"``, no label
  smoothing and no ``ld_alpha``: a row's log-likelihood ``pi`` is the sum of its masked token
  log-probs, its reference ``ref`` likewise from the stored reference log-probs, and per pair

      delta = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
      sigmoid: -log sigmoid(beta * delta)
      ipo:     (delta' - 1 / (2 beta))^2,  delta' = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r

  with ``n`` the row's masked token count (TRL divides by the completion tokens, at least 1); the
  loss is the mean over pairs (``denominator``: the pairs of the whole step).

Both return a ``losses.GRPOLossOutput`` so the trainer's metrics read them as the GRPO loss's:
``loss_objective`` is the loss, the KL and entropy terms are 0, ``clip_fraction`` and
``tis_masked`` are 0 (nothing is clipped or masked), ``kl_approx`` and ``ratio_mean`` compare the
policy with the behaviour log-probs passed as ``old_logprobs`` (how far it has moved from the
policy that sampled the rows), ``kl_to_ref`` the k3 to the reference where given.
"""

from __future__ import annotations

import torch

from rlhf_batch.core.losses import GRPOLossOutput, k3, masked_mean
from rlhf_batch.core.objectives import row_stats

PREFERENCE_LOSSES = ("sigmoid", "ipo")


def sft_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    denominator: float | None = None,
) -> GRPOLossOutput:
    """-sum(logp over mask) / denominator (the masked token count when None; at least 1)."""
    logprobs = _float(logprobs, mask)
    count = mask.sum().clamp(min=1) if denominator is None else denominator
    loss = -torch.where(mask, logprobs, 0.0).sum() / count  # []
    return _output(loss, logprobs, old_logprobs, mask, ref_logprobs, entropy)


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] each row's sum of its masked log-probs."""
    return torch.where(mask, logprobs, 0.0).sum(-1)  # [B]


def preference_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """[P] the loss of each pair from its sequence log-likelihoods [P] (see the module docstring);
    `ipo` needs the token counts [P]."""
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {loss_type!r}; expected one of {PREFERENCE_LOSSES}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen_ratio = chosen - ref_chosen.detach()  # [P]
    rejected_ratio = rejected - ref_rejected.detach()  # [P]
    if loss_type == "sigmoid":
        return -torch.nn.functional.logsigmoid(beta * (chosen_ratio - rejected_ratio))  # [P]
    if chosen_tokens is None or rejected_tokens is None:
        raise ValueError("the ipo loss needs chosen_tokens and rejected_tokens")
    delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)  # [P]
    return (delta - 1.0 / (2.0 * beta)) ** 2  # [P]


def dpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    entropy: torch.Tensor | None = None,
    denominator: float | None = None,
) -> GRPOLossOutput:
    """The mean preference loss of pairs laid out as rows [chosen 0, rejected 0, chosen 1, ...]
    (B even), summed / denominator (the pairs here when None)."""
    if logprobs.shape[0] % 2:
        raise ValueError(
            f"pairs need an even number of rows (chosen, rejected, ...), got {logprobs.shape[0]}"
        )
    logprobs = _float(logprobs, mask)
    ref = ref_logprobs.detach().to(logprobs.dtype)  # [B, T]
    pi, pi_ref = sequence_logps(logprobs, mask), sequence_logps(ref, mask)  # [B] each
    tokens = mask.sum(-1).to(logprobs.dtype)  # [B]
    per_pair = preference_losses(
        pi[0::2], pi[1::2], pi_ref[0::2], pi_ref[1::2], beta, loss_type, tokens[0::2], tokens[1::2]
    )  # [P]
    count = max(1, len(per_pair)) if denominator is None else denominator
    return _output(per_pair.sum() / count, logprobs, old_logprobs, mask, ref_logprobs, entropy)


def _float(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype != torch.bool or mask.shape != logprobs.shape or logprobs.dim() != 2:
        raise ValueError(f"mask must be bool [B, T] like logprobs {tuple(logprobs.shape)}")
    return logprobs.float() if logprobs.dtype in (torch.bfloat16, torch.float16) else logprobs


def _output(
    loss: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> GRPOLossOutput:
    """The loss with the metrics the trainer records (module docstring)."""
    logp = logprobs.detach()  # [B, T]
    old = old_logprobs.detach().to(logp.dtype)  # [B, T]
    log_ratio = torch.where(mask, logp - old, 0.0)  # [B, T], masked before exp
    ratio = torch.exp(log_ratio)  # [B, T]
    zero = logp.new_zeros(())  # []
    none = torch.zeros_like(mask)  # [B, T]
    kl_to_ref = zero
    if ref_logprobs is not None:
        kl_to_ref = masked_mean(k3(logp, ref_logprobs.detach().to(logp.dtype), mask), mask)  # []
    ent = masked_mean(entropy.detach().to(logp.dtype), mask) if entropy is not None else zero  # []
    return GRPOLossOutput(
        loss=loss,
        loss_objective=loss,
        loss_kl_to_ref=zero,
        loss_kl_to_inference=zero,
        loss_entropy=zero,
        clip_fraction=zero,
        kl_approx=masked_mean(ratio - 1.0 - log_ratio, mask),
        kl_to_ref=kl_to_ref,
        entropy=ent,
        ratio_mean=masked_mean(ratio, mask),
        tis_masked=zero,
        row_stats=row_stats(ratio, None, none, none, entropy, logp, old, mask),
    )
