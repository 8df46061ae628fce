"""Attention as batched matmuls, where torch's SDPA kernels for CPUs are slow.

`matmul_attention` is a transformers attention function. Every model `models.load_model` loads
with SDPA attention uses it (`use_matmul_attention`), and the sampler lends it to any other SDPA
model while it decodes. Per call it takes one of two routes:

- batched matmuls in the inputs' dtype: Q K^T, where the H / KV query heads that share a key
  head form one matrix (no key or value is repeated), the mask, a softmax (accumulated in
  float32), then P V. For one query per row (decode steps) on any device; for longer queries
  on a CPU in bfloat16 or float16 (bf16 autocast included) while the [b, H, q, L]
  probabilities stay within `MAX_SCORES` elements: under autograd every layer keeps them for
  backward, so a larger call goes to SDPA; without it (score, prefill) a larger call runs in
  slices of batch rows that each stay within it. On a CPU with AMX, bf16 prompts take it only
  under autograd: there SDPA's flash kernel runs on the AMX tiles and skips the blocks above
  the diagonal, and its forward is as fast or faster (all the score stage's calls: 0.94 s
  against 1.40 s, the best route per call 0.91 s), while its backward is not (forward +
  backward 0.67-0.83x SDPA's time).
- transformers' SDPA for the rest: float32 or CUDA prompts (its fused kernels are as fast or
  faster there), bf16 prompts without autograd on AMX, a single row over the bound, larger
  calls under autograd, dropout, soft-capping, attention sinks, a position bias, per-head
  masks.

`prefix_attention`, the other attention function here, is score's for responses run after
their shared prompts (`forward.shared_prefix_logprobs`): each prompt's keys held once. It merges
two attentions by their log-sum-exp (`attend_with_lse`), which a fused kernel returns: torch's
CPU flash kernel, on CUDA the flash or memory-efficient one (`lse_kernel`).

On a CPU with bf16 units (AMD EPYC, AVX512-BF16), a bf16 causal forward + backward of [14, 8,
286, 64] takes ~65 ms this way against ~100 ms in SDPA's flash kernel on one thread (43-49
against 56-62 ms on two); for a single bf16 query per row SDPA is several times slower (see
benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_batch.runtime import device

MATMUL_ATTENTION = "rlhf_batch_matmul"
PREFIX_ATTENTION = "rlhf_batch_prefix"
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
    q, length = query.shape[2], key.shape[2]
    causal = (
        q > 1
        and attention_mask is None
        and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    )
    dtype = _dtype(query)
    dropout_on = bool(dropout and module.training)
    rows = _rows_per_call(query, dtype, key.shape[1], length, attention_mask, causal, dropout_on, kwargs)
    if not rows:
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
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    with torch.autocast(query.device.type, enabled=False):  # in `dtype`, as SDPA under autocast
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        per_mask = attention_mask is not None and attention_mask.shape[0] > 1
        out = [
            _attend(
                query[i : i + rows],
                key[i : i + rows],
                value[i : i + rows],
                attention_mask[i : i + rows] if per_mask else attention_mask,  # type: ignore[index]
                causal,
                scale,
            )
            for i in range(0, query.shape[0], rows)
        ]
    return (out[0] if len(out) == 1 else torch.cat(out)), None


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """One call of the matmul route, in the inputs' dtype -> [b, q, H, D]."""
    b, h, q, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    g = h // kv
    scores = torch.matmul((query * scale).reshape(b, kv, g * q, d), key.transpose(-1, -2))  # [b, KV, g q, L]
    scores = scores.view(b, kv, g, q, length)
    if causal or mask is not None:
        scores.add_(_bias(mask, q, scores.dtype, query.device))
    weights = torch.softmax(scores, dim=-1).view(b, kv, g * q, length)  # float32 accumulation
    out = torch.matmul(weights, value).view(b, h, q, d)  # [b, H, q, D]
    return out.transpose(1, 2).contiguous()


def _bias(mask: torch.Tensor | None, q: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The mask as a term added to the scores: 0 where a query attends, the dtype's lowest finite
    value where it does not (a row with every key masked stays finite); [q, q] causal when `mask`
    is None, else [b or 1, 1, 1, q, L]. Adding it costs a third of what `masked_fill_` with the
    bool mask broadcast over the heads does (1.2 against 3.8 ms on [5, 4, 2, 506, 748] bf16)."""
    low = torch.finfo(dtype).min
    if mask is None:
        return torch.full((q, q), low, dtype=dtype, device=device).triu(1)
    m = mask.unsqueeze(2)
    if m.dtype != torch.bool:  # additive already; float32's lowest is -inf in bf16
        return m.to(dtype).clamp(min=low)
    return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, low)


def _dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: under CPU autocast its dtype (rotary embeddings hand over
    float32 queries that SDPA would cast), else the query's."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return query.dtype


def _rows_per_call(
    query: torch.Tensor,
    dtype: torch.dtype,
    kv: int,
    length: int,
    mask: torch.Tensor | None,
    causal: bool,
    dropout: bool,
    kwargs: dict[str, Any],
) -> int:
    """Batch rows per call of the matmul route; 0 = SDPA. Without autograd a call over the bound
    runs in slices of rows (their probabilities are freed as they go); with it, SDPA."""
    b, h, q, _ = query.shape
    if h % kv or dropout or any(kwargs.get(k) is not None for k in _EXTRAS):
        return 0
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1):
        return 0
    if q == 1:
        return b
    if query.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or (causal and q != length):
        return 0
    if dtype == torch.bfloat16 and not torch.is_grad_enabled() and device.cpu_has_amx():  # module docstring
        return 0
    rows = MAX_SCORES // (h * q * length)
    return b if rows >= b else (rows if not torch.is_grad_enabled() else 0)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    for name, fn in ((MATMUL_ATTENTION, matmul_attention), (PREFIX_ATTENTION, prefix_attention)):
        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)  # the masks SDPA takes


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


# ---------------------------------------------------------------- responses after shared prompts


@dataclass
class PromptPrefix:
    """What `prefix_attention` attends to besides the responses themselves: per layer, each
    prompt's keys and values [KV, P_j, D] (each prompt once, however many rows continue it), and
    the batch's rows as spans (prompt j, first row, end row): rows continuing one prompt are
    adjacent."""

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    spans: list[tuple[int, int, int]]


def prefix_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    prompt_prefix: PromptPrefix,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function for responses run after their prompts: query [b, H, R,
    D], key / value [b, KV, R, D] of right-padded responses -> ([b, R, H, D], None), each row
    attending to its prompt's keys and causally to its own response's.

    Two attentions and their merge, instead of one over a cache of every row's prompt padded to
    the batch's longest (with a mask): each row's causal attention over its response
    (right-padded: a real position sees no pad), and the queries of the rows that continue
    prompt j against its keys, held once ([1, H, n_j R, D] x [1, KV, P_j, D]: no mask, no
    padding, no key repeated per row).
    """
    if attention_mask is not None or (dropout and module.training):
        raise ValueError("prefix attention takes no attention mask and no dropout")
    if torch.is_grad_enabled() and query.requires_grad:  # the merge writes the kernel's output in place
        raise RuntimeError("prefix attention has no backward: run it without gradients")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    dtype = _dtype(query)
    layer = module.layer_idx
    _, h, r, d = query.shape
    with torch.autocast(query.device.type, enabled=False):
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        out, lse = attend_with_lse(query, key, value, True, scale)  # [b, H, R, D], [b, H, R]
        for j, s, e in prompt_prefix.spans:
            q = query[s:e].transpose(0, 1).reshape(1, h, (e - s) * r, d)  # [1, H, n R, D]
            k, v = prompt_prefix.keys[layer][j][None], prompt_prefix.values[layer][j][None]  # [1, KV, P, D]
            o, lp = attend_with_lse(q, k.to(dtype), v.to(dtype), False, scale)  # [1, H, n R, D], [1, H, n R]
            o, lp = o.view(h, e - s, r, d).transpose(0, 1), lp.view(h, e - s, r).transpose(0, 1)
            merge_attention_(out[s:e], lse[s:e], o, lp)
    return out.transpose(1, 2).contiguous(), None


def attend_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool,
    scale: float,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of query [b, H, q, D] over key / value [b, KV, L, D] (H a multiple of
    KV; causal: query i sees keys 0..i) -> (out [b, H, q, D] in the query's dtype, the log of each
    query's softmax normaliser [b, H, q] float32). `fused` None: the kernel `lse_kernel` picks
    for the device; True: that device's fused kernel; False: float32 matmuls over slices of the
    queries whose scores stay within `MAX_SCORES` elements (any device)."""
    kernel = lse_kernel(query, key, causal) if fused is not False else "matmul"
    if kernel == "matmul" and fused:
        raise ValueError(
            f"no fused attention kernel returns the log-sum-exp here: {query.device}, {query.dtype}"
        )
    if kernel != "matmul":
        return fused_attention_lse(kernel, query, key, value, causal, scale)
    b, h, q, _ = query.shape
    length = key.shape[2]
    g = h // key.shape[1]
    k, v = key.float().repeat_interleave(g, 1), value.float().repeat_interleave(g, 1)  # [b, H, L, D]
    step = max(1, MAX_SCORES // (b * h * length))
    outs, lses = [], []
    for s in range(0, q, step):
        e = min(q, s + step)
        scores = query[:, :, s:e].float() @ k.transpose(-1, -2) * scale  # [b, H, e - s, L]
        if causal:  # query s + r sees keys 0..s + r
            later = torch.ones(e - s, length, dtype=torch.bool, device=scores.device).triu(s + 1)
            scores = scores.masked_fill(later, float("-inf"))
        lse = scores.logsumexp(-1)  # [b, H, e - s]
        outs.append(((scores - lse[..., None]).exp() @ v).to(query.dtype))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def lse_kernel(query: torch.Tensor, key: torch.Tensor, causal: bool, capability: int | None = None) -> str:
    """The kernel `attend_with_lse` runs: "cpu_flash" (torch's CPU flash kernel, any dtype), on
    CUDA "flash" (bf16 / fp16, head dim a multiple of 8 up to 256, compute capability >= 8:
    `capability`, the major version, read from the device when None) or "efficient" (the
    memory-efficient kernel: float32 too, head dim a multiple of 8 up to 128), else "matmul". Each
    fused one reads only the blocks at or below the diagonal of a causal square and returns
    the log-sum-exp; a causal call whose queries are not its keys (q != L) takes the matmuls
    on CUDA (the kernels' causal mask is aligned top-left there)."""
    dev, d = query.device.type, query.shape[-1]
    if dev == "cpu":
        return "cpu_flash"
    if dev not in ("cuda", "meta") or (causal and query.shape[2] != key.shape[2]) or d % 8:
        return "matmul"
    if capability is None:
        capability = torch.cuda.get_device_capability(query.device)[0] if dev == "cuda" else 8
    if query.dtype in (torch.bfloat16, torch.float16) and d <= 256 and capability >= 8:
        return "flash"
    if query.dtype in (torch.bfloat16, torch.float16, torch.float32) and d <= 128:
        return "efficient"
    return "matmul"


def fused_attention_lse(
    kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_with_lse` through one fused aten kernel (`lse_kernel`) -> (out [b, H, q, D],
    lse [b, H, q] float32). The CUDA kernels take as many key heads as query heads (keys and
    values are repeated per group, [b, H, L, D]); the memory-efficient one pads its
    log-sum-exp to a multiple of 32 queries, cut here. (The CUDA ops also run on the meta
    device, which checks shapes without a GPU.)"""
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scale
        )
        return out, lse
    g = query.shape[1] // key.shape[1]
    if g > 1:
        key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)  # [b, H, L, D]
    if kernel == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale
        )
    elif kernel == "efficient":
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, 0.0, causal, scale=scale
        )
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return res[0], res[1][..., : query.shape[2]].float()


def merge_attention_(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """Attentions of the same queries over two disjoint sets of keys ([..., D] outputs, [...]
    float32 log-normalisers) -> the attention over both sets, into `out_a`: softmax over the union
    weighs part b's output by its share of the normaliser, e^lse_b / (e^lse_a + e^lse_b) =
    sigmoid(lse_b - lse_a). One fused `lerp` (the weight in the outputs' dtype)."""
    out_a.lerp_(out_b, torch.sigmoid(lse_b - lse_a)[..., None].to(out_a.dtype))


@contextlib.contextmanager
def prefix_attention_for(model: Any) -> Iterator[None]:
    """The model's attention modules run `prefix_attention` for the duration of the block."""
    config: Any = model.config
    before = config._attn_implementation
    _register()
    config._attn_implementation = PREFIX_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
