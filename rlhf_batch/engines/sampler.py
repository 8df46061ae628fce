"""The decoding loop: left-padded prefill, KV cache, one token per row per step.

Two paths after the same prefill (`decode`): "dynamic" (the CPU default) grows a DynamicCache and
removes rows that finish (a stop token, or max_new_tokens) from the batch and the cache at once,
so the remaining steps cost only what the running rows need; it reads every step's tokens back
to the host. "static" (the CUDA default, engines/static_decode.py) preallocates the cache, keeps
finished rows, never waits on the device inside the loop and replays each step as a CUDA graph
on CUDA. Both give each row the same tokens (its own uniforms), log-probs within float rounding.

A model that uses SDPA attention decodes with `attention.matmul_attention` (batched matmuls: on
CPUs, torch's SDPA kernel for a single bfloat16 query is several times slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf_batch.core.logprobs import logprobs_from_logits
from rlhf_batch.core.sampling import filter_logits, sample_from_uniform
from rlhf_batch.models.attention import matmul_attention_for

UNIFORM_BLOCK = 64  # decode steps of uniforms drawn per row at a time


@torch.no_grad()
def sample(
    model: Any,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_ids: set[int] | None = None,
    pad_id: int = 0,
    banned_ids: set[int] | None = None,
    decode: str = "auto",
    check_every: int = 0,
) -> list[tuple[list[int], list[float], str]]:
    """Per row: (response token ids, behaviour log-probs, finish reason 'stop' | 'length').

    `max_new_tokens` is one budget for every row or one per row. `banned_ids` are never sampled
    (removed like top-k filtering: the log-prob stays the full-vocabulary one). `decode`: "auto"
    (static on CUDA, dynamic elsewhere), "static" or "dynamic" (module docstring); `check_every`:
    the static path's steps between its done checks (0: its default)."""
    with matmul_attention_for(model):
        device = next(model.parameters()).device
        if decode == "static" or (decode == "auto" and device.type == "cuda"):
            budget = (
                [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
            )
            out = _sample_static(
                model,
                prompts,
                seeds,
                budget,
                check_every,
                {
                    "temperature": temperature,
                    "top_p": top_p,
                    "top_k": top_k,
                    "pad_id": pad_id,
                    "stop_ids": stop_ids or set(),
                    "banned_ids": banned_ids or set(),
                },
            )
            if out is not None:
                return out
        return _sample(
            model, prompts, seeds, max_new_tokens, temperature, top_p, top_k, stop_ids, pad_id, banned_ids
        )


def _sample_static(
    model: Any,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    budget: list[int],
    check_every: int,
    options: dict[str, Any],
) -> list[tuple[list[int], list[float], str]] | None:
    """The static path (engines/static_decode.py); None when the model's cache cannot be static."""
    from rlhf_batch.engines import static_decode as sd

    device = next(model.parameters()).device
    width, steps = max(len(p) for p in prompts), max(budget)
    cache = sd.static_cache(model, width + steps)
    if cache is None:
        return None
    logits, prefix, attn, rows = _prefill_distinct(model, prompts, options["pad_id"], device)
    if rows is not None:
        logits, attn = logits[rows], attn[rows]  # [B, V], [B, L]
    sd.fill_cache(cache, prefix, rows, width)
    del prefix
    loop = sd.new_loop(logits, attn, attn.sum(-1), seeds, budget, options)
    step = sd.decode_step(model, cache, loop)
    sd.run_steps(step, loop, steps, check_every or sd.CHECK_EVERY, graph=device.type == "cuda")
    return loop.results()


def _sample(
    model: Any,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    max_new_tokens: int | Sequence[int],
    temperature: float,
    top_p: float,
    top_k: int,
    stop_ids: set[int] | None,
    pad_id: int,
    banned_ids: set[int] | None,
) -> list[tuple[list[int], list[float], str]]:
    device = next(model.parameters()).device
    n = len(prompts)
    logits, cache, attn, next_pos = _prefill(model, prompts, pad_id, device)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    stops = torch.as_tensor(sorted(stop_ids or set()), dtype=torch.long, device=device)  # [S]
    banned = torch.as_tensor(sorted(banned_ids or set()), dtype=torch.long, device=device)  # [K]
    live = torch.arange(n, device=device)  # [b] original row of each running row
    budget = torch.as_tensor(
        [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens), device=device
    )  # [B]
    steps = int(budget.max())
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    for step in range(steps):
        if step % UNIFORM_BLOCK == 0:  # each row's next uniforms from its own generator, as a block:
            n_u = min(UNIFORM_BLOCK, steps - step)  # the same stream as one draw per step, fewer calls
            block = torch.stack([torch.rand(n_u, generator=gens[r]) for r in live.tolist()])  # [b, n_u]
        u = block[:, step % UNIFORM_BLOCK].to(device)  # [b]
        tok, lp = _choose(logits, u, banned, temperature, top_k, top_p)  # [b], [b]
        stop = torch.isin(tok, stops)  # [b]
        for r, t, l_, d in zip(live.tolist(), tok.tolist(), lp.tolist(), stop.tolist(), strict=True):
            tokens[r].append(t)
            logps[r].append(l_)
            if d:
                reasons[r] = "stop"
        keep = (~stop & (budget[live] > step + 1)).nonzero().squeeze(-1)  # [b']
        if keep.numel() == 0:
            break
        if keep.numel() < live.numel():
            cache.batch_select_indices(keep)
            live, tok, attn, next_pos = live[keep], tok[keep], attn[keep], next_pos[keep]
            block = block[keep.cpu()]
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=-1)  # [b, L + step + 1]
        logits = model(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]  # [b, V]
        next_pos = next_pos + 1
    return [(tokens[i], logps[i], reasons[i]) for i in range(n)]


def _choose(
    logits: torch.Tensor, u: torch.Tensor, banned: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token from its uniform `u` (banned ids never drawn, top-k / top-p applied)
    and its log-prob over the full vocabulary in float32."""
    scaled = logits.float() / temperature  # [b, V]
    if banned.numel():
        scaled[:, banned] = float("-inf")
    tok = sample_from_uniform(filter_logits(scaled, top_k, top_p), u)  # [b]
    return tok, logprobs_from_logits(logits, tok, temperature)  # [b], [b] float32


def _prefill(model: Any, prompts: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[Any, ...]:
    """The left-padded prompts through the model once: (last logits [B, V], the KV cache, the
    attention mask [B, L], each row's next position [B]). A prompt that several rows share (the
    G samples of a group) runs once; its logits and cache are then copied to each of its rows."""
    logits, cache, attn, rows = _prefill_distinct(model, prompts, pad_id, device)
    if rows is not None:
        cache.batch_select_indices(rows)  # every layer's keys and values [U, ...] -> [B, ...]
        logits, attn = logits[rows], attn[rows]  # [B, V], [B, L]
    return logits, cache, attn, attn.sum(-1)


def _prefill_distinct(
    model: Any, prompts: Sequence[Sequence[int]], pad_id: int, device: Any
) -> tuple[Any, ...]:
    """The distinct prompts, left-padded, through the model once: (last logits [U, V], their
    DynamicCache, attention mask [U, L], each row's prompt [B] or None when every row has its own)."""
    from transformers import DynamicCache

    first: dict[tuple[int, ...], int] = {}
    row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]  # [B] -> distinct prompt
    distinct = list(first)
    n, width = len(distinct), max(len(p) for p in distinct)
    ids = torch.full((n, width), pad_id, dtype=torch.long)  # [U, L] left-padded
    attn = torch.zeros((n, width), dtype=torch.long)  # [U, L]
    for i, p in enumerate(distinct):
        ids[i, width - len(p) :] = torch.as_tensor(p)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [U, L]
    cache = DynamicCache()
    logits = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]  # [U, V]
    rows = torch.as_tensor(row_of, device=device) if n < len(prompts) else None  # [B]
    return logits, cache, attn, rows
