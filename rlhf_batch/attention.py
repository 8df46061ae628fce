"""Attention as batched matmuls, where torch's SDPA kernels for CPUs are slow.

`matmul_attention` is a transformers attention function. Every model `models.load_model` loads
with SDPA attention uses it (`use_matmul_attention`), and the sampler lends it to any other SDPA
model while it decodes. Per call it takes one of two routes:

- batched matmuls in the inputs' dtype: Q K^T, where the H / KV query heads that share a key
  head form one matrix (no key or value is repeated), the mask, a softmax (accumulated in
  float32), then P V. For one query per row (decode steps) on any device; for longer queries
  on a CPU in bfloat16 or float16 while the [b, H, q, L] probabilities stay within
  `MAX_SCORES` elements (under autograd every layer keeps its probabilities for backward).
- transformers' SDPA for the rest: float32 or CUDA prompts (its fused kernels are as fast or
  faster there), long sequences (the memory of the probabilities would not be bounded),
  dropout, soft-capping, attention sinks, a position bias, per-head masks.

On a CPU with bf16 units (AMD EPYC, AVX512-BF16), a bf16 causal forward + backward of [14, 8,
286, 64] takes ~65 ms this way against ~100 ms in SDPA's flash kernel; for a single bf16 query
per row SDPA is several times slower (see benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MATMUL_ATTENTION = "rlhf_batch_matmul"
MAX_SCORES = 1 << 24  # elements of one call's probabilities (32 MB in bf16; beyond, SDPA is as fast)
_EXTRAS = ("softcap", "s_aux", "sinks", "position_bias", "cache")  # what only SDPA handles


def matmul_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [b, H, q, D], key / value [b, KV, L, D], mask None or [b or 1, 1, q, L] (bool: True
    attends; float: added) -> ([b, q, H, D], None), as transformers' `sdpa_attention_forward`
    (which takes the calls this route does not: module docstring)."""
    b, h, q, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    causal = (
        q > 1
        and attention_mask is None
        and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    )
    dtype = _dtype(query)
    if not _fits(query, dtype, kv, length, attention_mask, causal, bool(dropout and module.training), kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    g = h // kv
    scale = d**-0.5 if scaling is None else scaling
    with torch.autocast(query.device.type, enabled=False):  # in `dtype`, as SDPA under autocast
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        scores = torch.matmul(
            (query * scale).reshape(b, kv, g * q, d), key.transpose(-1, -2)
        )  # [b, KV, g q, L]
        scores = scores.view(b, kv, g, q, length)
        low = torch.finfo(dtype).min  # finite: a row with every key masked gives no NaN
        if causal:
            scores.masked_fill_(torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1), low)
        elif attention_mask is not None:
            m = attention_mask.unsqueeze(2)  # [b or 1, 1, 1, q, L]
            scores.masked_fill_(~m, low) if m.dtype == torch.bool else scores.add_(m.to(dtype))
        weights = torch.softmax(scores, dim=-1).view(b, kv, g * q, length)  # float32 accumulation
        out = torch.matmul(weights, value).view(b, h, q, d)  # [b, H, q, D]
    return out.transpose(1, 2).contiguous(), None


def _dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: under CPU autocast its dtype (rotary embeddings hand over
    float32 queries that SDPA would cast), else the query's."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return query.dtype


def _fits(
    query: torch.Tensor,
    dtype: torch.dtype,
    kv: int,
    length: int,
    mask: torch.Tensor | None,
    causal: bool,
    dropout: bool,
    kwargs: dict[str, Any],
) -> bool:
    b, h, q, _ = query.shape
    if h % kv or dropout or any(kwargs.get(k) is not None for k in _EXTRAS):
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1):
        return False
    if q == 1:
        return True
    return (
        query.device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and (not causal or q == length)
        and b * h * q * length <= MAX_SCORES
    )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(MATMUL_ATTENTION, matmul_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(MATMUL_ATTENTION, sdpa_mask)  # the masks SDPA takes


def use_matmul_attention(model: Any) -> None:
    """A model loaded with SDPA attention attends with `matmul_attention` from now on."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        _register()
        config._attn_implementation = MATMUL_ATTENTION


@contextlib.contextmanager
def matmul_attention_for(model: Any) -> Iterator[None]:
    """`use_matmul_attention` for the duration of the block; the model's setting is put back."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    use_matmul_attention(model)
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
