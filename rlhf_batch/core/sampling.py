"""Sampling one token per row: temperature, top-k, top-p, and inverse-CDF draws from
per-row uniforms (so each row's randomness is its own, whatever the batch holds)."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[B, V] scaled logits -> the same with tokens outside top-k / the top-p nucleus at -inf."""
    out = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]  # [B, 1]
        out = out.masked_fill(out < kth, float("-inf"))  # [B, V]
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
        before = probs.cumsum(-1) - probs  # [B, V] mass of the strictly more likely tokens
        drop_sorted = before >= top_p  # [B, V] the most likely token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [B, V]
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_from_uniform(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, V] logits (possibly -inf), [B] uniforms in [0, 1) -> [B] token ids by inverse CDF."""
    probs = torch.softmax(logits.float(), dim=-1)  # [B, V]
    cdf = probs.cumsum(-1)  # [B, V]
    target = (u.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B] first token with cdf > target
    return idx.clamp_(max=logits.shape[-1] - 1)
