"""Log-probs of chosen tokens, the one definition every stage uses.

log p(token) = log_softmax(logits / temperature)[token] over the full vocabulary, computed in
float32 whatever the model's dtype. Never materialises a float32 [tokens x vocab] tensor for a
whole batch: rows are processed in chunks (gather minus logsumexp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def log_softmax32(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 log_softmax(logits / temperature). One fused
    log_softmax kernel (on CPU about twice as fast as gather minus logsumexp, which makes several
    passes over the logits); no division at temperature 1."""
    x = logits.float()  # [..., V]
    return torch.log_softmax(x if temperature == 1.0 else x / temperature, dim=-1)


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[..., V] logits, [...] targets -> [...] float32 log-probs of the targets."""
    return log_softmax32(logits, temperature).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """[..., V] log-probs -> [...] entropy -sum p log p."""
    return -(logp.exp() * logp).sum(-1)


class _TokenLogprobs(torch.autograd.Function):
    """logits [c, V] -> (log-prob of each row's target [c], entropy [c] or a 0-dim zero), float32,
    with a backward written out (autograd's would allocate a zero [c, V] tensor for the gather,
    scatter into it and run log_softmax's backward on top: three more passes over the logits).

    With p = softmax(x), x = logits / T:  d logp_t / d x_j = [j = t] - p_j, and for the entropy
    H = -sum_j p_j logp_j:  dH / d x_j = -p_j (logp_j + H).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp = log_softmax32(logits, temperature)  # [c, V]
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [c]
        ent = entropy_of(logp) if with_entropy else lp.new_zeros(())  # [c] or []
        ctx.save_for_backward(logp, targets, ent)
        ctx.temperature, ctx.with_entropy, ctx.dtype = temperature, with_entropy, logits.dtype
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        logp, targets, ent = ctx.saved_tensors
        coef = g_lp[:, None]  # [c, 1]
        if ctx.with_entropy:
            coef = coef + g_ent[:, None] * (logp + ent[:, None])  # [c, V]
        grad = logp.exp().mul_(coef).neg_()  # [c, V]: -p_j (g_lp + g_ent (logp_j + H))
        grad.scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1))  # + g_lp at j = t
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of `targets` from hidden states, `chunk_size` rows at a time.

    hidden [N, H] -> head -> logits [chunk, V]; only one chunk's logits exist at a time. When
    gradients are on, each chunk is checkpointed, so backward recomputes its logits instead of
    keeping all of them alive.
    """

    def one(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _TokenLogprobs.apply(head(h), t, temperature, with_entropy)  # type: ignore[no-any-return]

    lps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]  # [c, H], [c]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(one, h, t, use_reentrant=False)
        else:
            lp, ent = one(h, t)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
