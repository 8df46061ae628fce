"""Log-probs of chosen tokens, the one definition every stage uses.

log p(token) = log_softmax(logits / temperature)[token] over the full vocabulary, computed in
float32 whatever the model's dtype. Never materialises a float32 [tokens x vocab] tensor for a
whole batch: rows are processed in chunks (one fused log_softmax per chunk).

A plain linear LM head is part of one function (`_LinearLogprobs`), with gradients or not: its
[chunk, V] buffers are made once per call, and backward recomputes each chunk's logits, writes
their gradient into a block of rows, and each block adds its share of the head's weight
gradient into one float32 buffer. Applying the head chunk by chunk through autograd instead
gives every chunk a weight gradient of its own, [V, H] from an inner dimension of a few dozen
rows, cast and summed one by one: on a CPU that was most of a train step's LM-head time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

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


def plain_linear(head: Any) -> TypeGuard[torch.nn.Linear]:
    """Whether `head` is an `nn.Linear` itself (not a subclass: quantized, LoRA), which
    `chunked_logprobs` runs through `linear_logprobs`."""
    return type(head) is torch.nn.Linear


def chunked_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of `targets` from hidden states, `chunk_size` rows at a time.

    hidden [N, H] -> head -> logits [chunk, V]; only one chunk's logits exist at a time. A plain
    `nn.Linear` head goes through `linear_logprobs`; any other head (a logit transform, LoRA, a
    quantized layer) is called per chunk, and when gradients are on each chunk is checkpointed,
    so backward recomputes its logits instead of keeping all of them alive.
    """
    if plain_linear(head) and hidden.shape[0]:
        return linear_logprobs(hidden, head.weight, head.bias, targets, temperature, chunk_size, with_entropy)

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


# Logit gradients held at once in backward ([rows, V] in the compute dtype; the logits recomputed
# at once stay within them too): enough rows for the weight-gradient matmul, summed over rows,
# to run near the peak. Forward + backward of 2048 rows, bf16 on a CPU with AMX, 512-row chunks:
# vocab 32000 x 512, 140 against 194 us a row with 64 MB; vocab 151936 x 896, 1332 against 2050.
GRAD_BLOCK_BYTES = 160 << 20


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    block_bytes: int = GRAD_BLOCK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunked_logprobs` for the head `hidden @ weight.T + bias` ([N, H] -> [N, V]), with the
    head's gradients (hidden, weight, bias) from one function; see the module docstring."""
    dev = hidden.device.type  # the head runs in autocast's dtype when it is on, as nn.Linear would
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    lp, ent = _LinearLogprobs.apply(
        hidden, weight, bias, targets, temperature, chunk_size, with_entropy, dtype, block_bytes
    )
    return lp, (ent if with_entropy else None)


class _LinearLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) -> (log-probs [N], entropies
    [N] or [0]) float32. The head runs in `dtype`, `chunk` rows at a time, into [chunk, V]
    buffers made once per call (a fresh tensor of that size per chunk costs its page faults
    again); only the per-row log-normaliser (and entropy) is kept for backward, which recomputes
    the logits.

    Backward per row, with p = softmax(x), x = logits / T (as in `_TokenLogprobs`):
    d x_j = (-p_j (g_lp + g_ent (logp_j + H)) + [j = t] g_lp) / T; then for a block of rows,
    d hidden = dX @ W, d W += dX^T @ hidden (float32 sum over blocks), d b += sum of dX's rows.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        dtype: torch.dtype,
        block_bytes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w, b = weight.to(dtype), (bias.to(dtype) if bias is not None else None)  # [V, H], [V]
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float32)  # [N]
        lse = torch.empty_like(lp)  # [N] log sum_j exp(x_j)
        ent = torch.empty_like(lp) if with_entropy else lp.new_zeros(0)  # [N] or [0]
        rows = pass_rows(w.shape[0], hidden.device.type)
        buf = _Buffers(min(chunk, n), w, rows)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            logits = buf.logits(hidden[c0:c1], w, b)  # [c, V] in dtype
            for s0 in range(c0, c1, rows):  # the float32 passes, a few rows at a time
                s1 = min(c1, s0 + rows)
                x = buf.scaled(logits[s0 - c0 : s1 - c0], temperature)  # [s, V]
                logp = torch.log_softmax(x, -1, out=buf.b[: s1 - s0])  # [s, V]
                t = targets[s0:s1, None]  # [s, 1]
                lp[s0:s1] = logp.gather(-1, t).squeeze(-1)
                lse[s0:s1] = x.gather(-1, t).squeeze(-1) - lp[s0:s1]
                if with_entropy:
                    ent[s0:s1] = torch.exp(logp, out=x).mul_(logp).sum(-1).neg_()  # -sum p log p
        ctx.save_for_backward(hidden, w, b, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.block_bytes = temperature, chunk, block_bytes
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, (bias.dtype if bias is not None else None)
        ctx.set_materialize_grads(False)  # an unused output (a detached entropy) costs nothing
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, w, b, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, v, chunk = hidden.shape[0], w.shape[0], ctx.chunk
        acc = torch.promote_types(ctx.weight_dtype, torch.float32)  # the weight gradient's sum
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        grad_w = grad_b = part = None
        dev = hidden.device.type
        block_bytes = ctx.block_bytes if dev == "cpu" else max(ctx.block_bytes, 2 * DEVICE_PASS_BYTES)
        rows = max(1, min(n, block_bytes // max(1, v * w.element_size())))  # rows of a block
        chunk = min(chunk, rows)  # the logits recomputed at once: within a block
        passes = pass_rows(v, dev)
        buf = _Buffers(chunk, w, passes)
        for b0 in range(0, n, rows):
            b1 = min(n, b0 + rows)
            h = hidden[b0:b1].to(w.dtype)  # [R, H]
            dx = torch.empty(b1 - b0, v, dtype=w.dtype, device=w.device)  # [R, V]
            for c0 in range(b0, b1, chunk):
                c1 = min(b1, c0 + chunk)
                logits = buf.logits(h[c0 - b0 : c1 - b0], w, b)  # [c, V] in w's dtype
                for s0 in range(c0, c1, passes):  # the float32 passes, a few rows at a time
                    s1 = min(c1, s0 + passes)
                    x = buf.scaled(logits[s0 - c0 : s1 - c0], ctx.temperature)  # [s, V]
                    logp = x.sub_(lse[s0:s1, None])  # [s, V]
                    g = torch.exp(logp, out=buf.b[: s1 - s0])  # [s, V] p
                    if g_ent is not None:  # coef = g_ent (logp + H) + g_lp
                        coef = logp.add_(ent[s0:s1, None]).mul_(g_ent[s0:s1, None])  # [s, V]
                        g.mul_(coef if g_lp is None else coef.add_(g_lp[s0:s1, None])).neg_()
                    elif g_lp is not None:
                        g.mul_(g_lp[s0:s1, None]).neg_()
                    else:
                        g.zero_()
                    if g_lp is not None:
                        g.scatter_add_(-1, targets[s0:s1, None], g_lp[s0:s1, None])
                    if ctx.temperature != 1.0:
                        g.div_(ctx.temperature)
                    dx[s0 - b0 : s1 - b0] = g
            if need_h:
                grad_h[b0:b1] = dx @ w  # type: ignore[index]
            if need_w:  # dx^T @ h [V, H]: one matmul over the block's rows, summed in float32
                if grad_w is None:
                    part = dx.t() @ h
                    grad_w = part.to(acc)
                elif w.dtype == acc:
                    grad_w.addmm_(dx.t(), h)
                else:
                    grad_w.add_(torch.mm(dx.t(), h, out=part))
            if need_b:
                s = dx.sum(0, dtype=acc)  # [V]
                grad_b = s if grad_b is None else grad_b.add_(s)
        grad_w = grad_w.to(ctx.weight_dtype) if grad_w is not None else None
        grad_b = grad_b.to(ctx.bias_dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


# Rows per float32 pass, forward and backward: the head's matmul runs over a whole chunk (its
# efficiency needs rows), the float32 copy and log-softmax (backward: the softmax's gradient)
# over [16, V] slices of its output, which stay in the core's cache between passes (over a [262,
# 32000] chunk they went through memory: 8.5 against 11.4 ms per chunk, matmul included, bf16 on
# a CPU with AMX; the same numbers; forward + backward of 2048 rows: 225 -> 219 us a row at
# 65-row chunks, 222 -> 205 at 256). A small vocabulary takes more rows per pass, up to
# PASS_ELEMENTS logits: passes of 16 rows of the demo's 105 cost their calls (a train step's
# forward 6.3 -> 5.4 ms with whole-chunk passes).
#
# On an accelerator (any device but a CPU) a pass is one kernel launch per op however many rows
# it covers, and a [16, V] pass leaves most of its cores idle: there a pass holds as many rows as
# fit `DEVICE_PASS_BYTES` of float32 logits (441 rows of a 151,936 vocabulary) and a backward
# block's logit gradients twice that many bytes in the head's dtype (bf16: 1766 rows, four
# passes). At 151,936 in bf16 that holds ~1.5 GB at once in backward, ~0.8 GB in forward.
PASS_ROWS = 16
PASS_ELEMENTS = 1 << 19  # 16 rows of a 32k vocabulary
DEVICE_PASS_BYTES = 256 << 20


def pass_rows(vocab: int, device_type: str = "cpu") -> int:
    """Rows per float32 pass of `_LinearLogprobs` for a head of `vocab` outputs on a device of
    type `device_type` ("cpu": the cache-sized passes above; else sized by DEVICE_PASS_BYTES)."""
    if device_type != "cpu":
        return max(PASS_ROWS, DEVICE_PASS_BYTES // (4 * max(1, vocab)))
    return max(PASS_ROWS, PASS_ELEMENTS // max(1, vocab))


class _Buffers:
    """Buffers of one `_LinearLogprobs` pass: the logits [rows, V] in the head's dtype (`lo`) and
    two float32 ones [slice_rows, V] (`a`: the scaled logits, then what a pass derives from them;
    `b`); `a` is `lo` when that is float32."""

    def __init__(self, rows: int, w: torch.Tensor, slice_rows: int | None = None):
        slice_rows = rows if slice_rows is None else min(rows, slice_rows)
        self.lo = torch.empty(rows, w.shape[0], dtype=w.dtype, device=w.device)
        self.b = torch.empty(slice_rows, w.shape[0], dtype=torch.float32, device=w.device)
        self.a = self.lo if w.dtype == torch.float32 else torch.empty_like(self.b)

    def logits(self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """h [c, H] -> h @ w.T + b [c, V] in w's dtype."""
        out, h = self.lo[: h.shape[0]], h.to(w.dtype)
        return torch.mm(h, w.t(), out=out) if b is None else torch.addmm(b, h, w.t(), out=out)

    def scaled(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """logits [c, V] (rows of `lo`) -> float32 logits / temperature [c, V], as log_softmax32
        scales them (in place where they are float32 already)."""
        x = logits if logits.dtype == torch.float32 else self.a[: logits.shape[0]].copy_(logits)
        return x if temperature == 1.0 else x.div_(temperature)
