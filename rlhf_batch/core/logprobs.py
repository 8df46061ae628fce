"""Log-probs of chosen tokens, the one definition every stage uses.

log p(token) = log_softmax(logits / temperature)[token] over the full vocabulary, computed in
float32 whatever the model's dtype. Never materialises a float32 [tokens x vocab] tensor for a
whole batch: rows are processed in chunks (gather minus logsumexp).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[..., V] logits, [...] targets -> [...] float32 log-probs of the targets."""
    x = logits.float() / temperature  # [..., V]
    picked = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(x, dim=-1)  # [...]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] logits -> [...] float32 entropy of softmax(logits / temperature)."""
    x = logits.float() / temperature  # [..., V]
    logp = torch.log_softmax(x, dim=-1)  # [..., V]
    return -(logp.exp() * logp).sum(-1)  # [...]


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
        logits = head(h)  # [c, V]
        lp = logprobs_from_logits(logits, t, temperature)  # [c]
        ent = entropy_from_logits(logits, temperature) if with_entropy else lp.new_zeros(())
        return lp, ent

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
