"""The static decode path of our sampler: every buffer sized once, no host sync inside the loop,
and on CUDA the decode step replayed as a CUDA graph.

- The KV cache is transformers' `StaticCache`: per layer one [B, KV, W + T, D] tensor for keys
  and one for values (W the batch's longest prompt, T its largest token budget), filled by the
  prefill and written in place, one slot a step. The attention mask is one [B, 1, 1, W + T]
  bool tensor whose next column is switched on each step; slots not yet written are masked, so a
  row attends to exactly the keys the growing cache of the dynamic path holds.
- Finished rows stay in the batch (never compacted): each step still runs them, feeds them the
  pad token and discards what they sample; `done`, the recorded tokens, log-probs and lengths
  live on the device.
- Whether every row is done is copied to host memory without blocking every `check_every`
  steps and read once that copy has landed (a CUDA event): the host never waits on the device
  inside the loop, so it queues steps ahead of the GPU. The results are read once, at the end.
- On CUDA one decode step (forward, sampling, bookkeeping) is captured as a `torch.cuda.CUDAGraph`
  after one eager warm-up step and replayed: a step is one launch instead of ~1,000 kernels.

Each row draws its uniforms from its own generator (every step's at once, the same stream the
dynamic path draws in blocks), so a row's tokens do not depend on its batch neighbours or the
batch size, up to float rounding of batch shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_batch.core.logprobs import logprobs_from_logits
from rlhf_batch.core.sampling import filter_logits, sample_from_uniform

CHECK_EVERY = 16  # decode steps between the non-blocking "is every row done?" checks


def static_cache(model: Any, max_len: int) -> Any:
    """An empty `StaticCache` of `max_len` slots for the model, or None when one of its layers is
    not a plain full-attention layer (sliding windows, hybrid caches: the dynamic path decodes)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in ("sdpa", "rlhf_batch_matmul"):  # a 4-D bool mask is what these take as given
        return None
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    return cache if all(type(layer) is StaticLayer for layer in cache.layers) else None


@dataclass
class Loop:
    """The decode state, all on the device; every step updates it in place."""

    tok: torch.Tensor  # [B] the token the next forward reads
    pos: torch.Tensor  # [B] its position
    step: torch.Tensor  # [1] index of the token the next `advance` records
    slot: torch.Tensor  # [1] the cache slot the next forward writes
    mask: torch.Tensor  # [B, 1, 1, W + T] bool: the keys each row attends to
    u: torch.Tensor  # [B, T] each row's uniform for each step
    budget: torch.Tensor  # [B] each row's max_new_tokens
    stops: torch.Tensor  # [S] stop ids
    banned: torch.Tensor  # [V] bool: never sampled
    done: torch.Tensor  # [B] bool
    stopped: torch.Tensor  # [B] bool: ended on a stop id
    length: torch.Tensor  # [B] tokens recorded
    out_tok: torch.Tensor  # [B, T]
    out_lp: torch.Tensor  # [B, T] float32
    pad: int
    temperature: float
    top_k: int
    top_p: float

    def advance(self, logits: torch.Tensor) -> None:
        """Sample each row's token of step `step` from `logits` [B, V] and record it for live rows."""
        u = self.u.index_select(1, self.step).squeeze(1)  # [B]
        scaled = (logits.float() / self.temperature).masked_fill_(self.banned, float("-inf"))  # [B, V]
        tok = sample_from_uniform(filter_logits(scaled, self.top_k, self.top_p), u)  # [B]
        lp = logprobs_from_logits(logits, tok, self.temperature)  # [B] float32
        live = ~self.done  # [B]
        self.out_tok.index_copy_(1, self.step, tok[:, None])
        self.out_lp.index_copy_(1, self.step, lp[:, None])
        self.length += live
        hit = (tok[:, None] == self.stops).any(-1)  # [B]
        self.stopped |= live & hit
        self.done |= hit | (self.step + 1 >= self.budget)
        self.tok.copy_(torch.where(self.done, torch.full_like(tok, self.pad), tok))
        self.step += 1

    def results(self) -> list[tuple[list[int], list[float], str]]:
        """Per row (response ids, log-probs, finish reason): the one read back from the device."""
        toks, lps = self.out_tok.tolist(), self.out_lp.tolist()
        lengths, stopped = self.length.tolist(), self.stopped.tolist()
        return [
            (t[:n], lp[:n], "stop" if s else "length")
            for t, lp, n, s in zip(toks, lps, lengths, stopped, strict=True)
        ]


def new_loop(
    logits: torch.Tensor,
    attn: torch.Tensor,
    next_pos: torch.Tensor,
    seeds: Sequence[int],
    budget: Sequence[int],
    options: dict[str, Any],
) -> Loop:
    """The state after the prefill (last logits [B, V], mask [B, W], next positions [B]); records
    step 0's token. `options`: stop_ids, banned_ids, pad_id, temperature, top_k, top_p."""
    device, (b, width), steps = logits.device, attn.shape, max(budget)
    mask = torch.zeros((b, 1, 1, width + steps), dtype=torch.bool, device=device)
    mask[:, 0, 0, :width] = attn.bool()
    u = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in seeds])
    banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
    banned[sorted(options["banned_ids"])] = True
    zeros = torch.zeros(b, dtype=torch.long, device=device)
    loop = Loop(
        tok=zeros.clone(),
        pos=next_pos.clone(),
        step=torch.zeros(1, dtype=torch.long, device=device),
        slot=torch.full((1,), width, dtype=torch.long, device=device),
        mask=mask,
        u=u.to(device),
        budget=torch.as_tensor(list(budget), device=device),
        stops=torch.as_tensor(sorted(options["stop_ids"]), dtype=torch.long, device=device),
        banned=banned,
        done=zeros.bool(),
        stopped=zeros.bool(),
        length=zeros.clone(),
        out_tok=torch.zeros((b, steps), dtype=torch.long, device=device),
        out_lp=torch.zeros((b, steps), dtype=torch.float32, device=device),
        pad=options["pad_id"],
        temperature=options["temperature"],
        top_k=options["top_k"],
        top_p=options["top_p"],
    )
    loop.advance(logits)
    return loop


def fill_cache(cache: Any, prefix: Any, rows: torch.Tensor | None, width: int) -> None:
    """Copy the prefill's keys and values (a DynamicCache of U distinct prompts, `rows` [B] picking
    each row's, None: one per row) into the first `width` slots of the static cache."""
    for layer, src in zip(cache.layers, prefix.layers, strict=True):
        keys, values = (src.keys, src.values) if rows is None else (src.keys[rows], src.values[rows])
        layer.lazy_initialization(keys, values)  # [B, KV, W + T, D] zeros, once
        layer.keys[:, :, :width].copy_(keys)
        layer.values[:, :, :width].copy_(values)
        layer.cumulative_length.fill_(width)


def decode_step(model: Any, cache: Any, loop: Loop) -> Callable[[], None]:
    """One decode step over the whole batch: the forward of the last tokens, then `advance`."""

    def step() -> None:
        loop.mask.index_fill_(3, loop.slot, True)
        logits = model(
            input_ids=loop.tok[:, None],
            attention_mask=loop.mask,
            position_ids=loop.pos[:, None],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]  # [B, V]
        loop.pos += 1
        loop.slot += 1
        loop.advance(logits)

    return step


def run_steps(step: Callable[[], None], loop: Loop, steps: int, check_every: int, graph: bool) -> int:
    """Steps 1..steps-1 (step 0 came from the prefill), stopping soon after every row is done;
    returns the steps run. `graph`: after one eager step, the rest replay a captured CUDA graph."""
    flag = AllDone(loop.done)
    run, ran = step, 0
    for s in range(1, steps):
        if graph and run is step:
            run = capture(step)  # runs this step eagerly, then records the next ones' graph
        else:
            run()
        ran += 1
        if s % check_every == 0:
            flag.launch()  # on a CPU it lands at once; on CUDA it is usually read at the next check
            if flag.finished():
                break
    return ran


def capture(step: Callable[[], None]) -> Callable[[], None]:
    """Run `step` once eagerly on a side stream (the warm-up CUDA graphs need: lazy allocations,
    library handles), then record it as a CUDA graph (recording runs nothing); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as e:  # an op the model cannot capture: decode eagerly (recording ran nothing)
        import warnings

        warnings.warn(
            f"generate: the decode step cannot be a CUDA graph ({str(e).splitlines()[0]}); decoding eagerly",
            stacklevel=2,
        )
        return step
    return graph.replay


class AllDone:
    """Whether every row is done, read without waiting on the device: `launch` queues a copy of
    `done.all()` into (pinned) host memory; `finished` reads it once a CUDA event says the copy
    landed (on a CPU the copy is done when `launch` returns)."""

    def __init__(self, done: torch.Tensor):
        cuda = done.device.type == "cuda"
        self.done = done
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False

    def launch(self) -> None:
        if not self.pending:
            self.host.copy_(self.done.all(), non_blocking=True)
            if self.event is not None:
                self.event.record()
            self.pending = True

    def finished(self) -> bool:
        if not self.pending or (self.event is not None and not self.event.query()):
            return False
        self.pending = False
        return bool(self.host.numpy())  # host memory: no wait on the device
