"""The `hf` engine: our sampler (engines/sampler.py) over the transformers model.

Rows per batch: `generate.batch_size`, or with "auto" (the default) as many as fit in the
device's free memory (docs/configuration.md has the formula):

    rows = floor(0.9 x free / per_row)
    per_row = 2 x layers x kv_heads x head_dim x (W + T) x e    the KV cache (keys and values)
            + W x (intermediate + 4 x hidden) x e                 the prefill's activations
            + 8 x vocab x 4                                       a step's float32 logits buffers

with W the batch's longest prompt, T = max_new_tokens, e the model dtype's bytes, and `free` the
CUDA device's free memory (plus what torch's allocator holds unused) or `RLHF_BATCH_GENERATE_MEMORY`
bytes when set; on a CPU without it, 64 rows. A batch that still runs out of memory is split in
halves and decoded again (nothing of it was kept), down to one row.
"""

from __future__ import annotations

import os
from typing import Any

from rlhf_batch.config import CPU_BATCH_SIZE, Config
from rlhf_batch.data.prompts import Prompts
from rlhf_batch.engines.base import check_lengths, stop_ids
from rlhf_batch.errors import StageError, UserError
from rlhf_batch.runtime import dist
from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.runtime.progress import Rate

MEMORY_ENV = "RLHF_BATCH_GENERATE_MEMORY"  # bytes batch_size = "auto" may fill (default: free device memory)
HEADROOM = 0.9  # share of that memory the batch is sized to


def row_bytes(model: Any, width: int, new_tokens: int) -> int:
    """Memory one decoded row needs: its KV cache, its share of the prefill, its logits (module
    docstring)."""
    c = model.config.get_text_config(decoder=True)
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    e = next(model.parameters()).element_size()
    cache = 2 * c.num_hidden_layers * kv * head_dim * (width + new_tokens) * e
    prefill = width * (getattr(c, "intermediate_size", 4 * c.hidden_size) + 4 * c.hidden_size) * e
    return int(cache + prefill + 8 * c.vocab_size * 4)


def memory_budget(device: Any) -> int | None:
    """Bytes a batch may fill: RLHF_BATCH_GENERATE_MEMORY, else a CUDA device's free memory (None
    on a CPU)."""
    import torch

    env = os.environ.get(MEMORY_ENV, "")
    if env:
        if not (env.isascii() and env.isdigit()) or int(env) < 1:
            raise UserError(f"{MEMORY_ENV}: must be a number of bytes >= 1, got {env!r}")
        return int(env)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def auto_rows(model: Any, width: int, new_tokens: int) -> int:
    """Rows per batch for batch_size = "auto" at prompt width `width` (module docstring)."""
    budget = memory_budget(next(model.parameters()).device)
    if budget is None:
        return CPU_BATCH_SIZE
    return max(1, int(HEADROOM * budget) // row_bytes(model, width, new_tokens))


class HFEngine:
    """The `hf` engine: our sampler over the transformers model (KV cache, rows leave the batch
    when they finish, batches of similar prompt length). An engine turns prompts into
    (response_ids, behavior_logprobs, finish_reason) rows; every engine writes the same schema."""

    def __init__(self, cfg: Config, policy: str, tok: Any, prompts: Prompts):
        from rlhf_batch.models.load import load_model

        self.g = cfg.generate
        self.model = load_model(
            policy,
            "policy",
            device=dist.stage_device(cfg.device),
            dtype=cfg.dtype,
            trust_remote_code=cfg.trust_remote_code,
        )
        fault_point("rollouts:model-loaded")
        check_lengths(self.model, prompts, self.g)
        self.stop_ids, self.pad_id = stop_ids(self.model, tok), tok.pad_token_id
        # the pad token is never sampled (unless it also ends a row)
        self.banned_ids = set() if self.pad_id is None else {self.pad_id} - self.stop_ids

    def sample(
        self, prompts: list[list[int]], seeds: list[int], bar: Any
    ) -> list[tuple[list[int], list[float], str]]:
        """One row per prompt (and seed), in input order; longest prompts are decoded first, in
        batches of `rows` (module docstring), halved after running out of memory."""
        import torch

        order = sorted(range(len(prompts)), key=lambda r: (-len(prompts[r]), r))
        results: list[Any] = [None] * len(prompts)
        self.rate = getattr(self, "rate", None) or Rate()  # over every part of this stage run
        self.rate.begin()
        start, cap = 0, len(order)
        while start < len(order):
            batch = order[start : start + min(cap, self.rows(len(prompts[order[start]])))]
            try:
                out = self.sample_batch([prompts[r] for r in batch], [seeds[r] for r in batch])
            except torch.OutOfMemoryError:
                if len(batch) == 1:
                    raise StageError(
                        f"generate: one row of {len(prompts[batch[0]])} prompt tokens + "
                        f"{self.g.max_new_tokens} new tokens does not fit in the device's memory"
                    ) from None
                cap = len(batch) // 2
                torch.cuda.empty_cache()
                continue
            for r, res in zip(batch, out, strict=True):
                results[r] = res
            start += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{self.rate.add(sum(len(o[0]) for o in out)):.0f}")
        return results

    def rows(self, width: int) -> int:
        """Rows per batch whose longest prompt has `width` tokens."""
        if self.g.batch_size != "auto":
            return int(self.g.batch_size)
        return auto_rows(self.model, width, self.g.max_new_tokens)

    def sample_batch(
        self, prompts: list[list[int]], seeds: list[int]
    ) -> list[tuple[list[int], list[float], str]]:
        from rlhf_batch.engines.sampler import sample

        g = self.g
        return sample(
            self.model,
            prompts,
            seeds,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            stop_ids=self.stop_ids,
            pad_id=self.pad_id,
            banned_ids=self.banned_ids,
        )
