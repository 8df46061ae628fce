"""The `hf` engine: our sampler (engines/sampler.py) over the transformers model."""

from __future__ import annotations

from typing import Any

from rlhf_batch.config import Config
from rlhf_batch.data.prompts import Prompts
from rlhf_batch.engines.base import check_lengths, stop_ids
from rlhf_batch.runtime import dist
from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.runtime.progress import Rate


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
        """One row per prompt (and seed), in input order; longest prompts are decoded first."""
        from rlhf_batch.engines.sampler import sample

        g = self.g
        order = sorted(range(len(prompts)), key=lambda r: (-len(prompts[r]), r))
        results: list[Any] = [None] * len(prompts)
        self.rate = getattr(self, "rate", None) or Rate()  # over every part of this stage run
        self.rate.begin()
        for start in range(0, len(order), g.batch_size):
            batch = order[start : start + g.batch_size]
            out = sample(
                self.model,
                [prompts[r] for r in batch],
                [seeds[r] for r in batch],
                max_new_tokens=g.max_new_tokens,
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=g.top_k,
                stop_ids=self.stop_ids,
                pad_id=self.pad_id,
                banned_ids=self.banned_ids,
            )
            for r, res in zip(batch, out, strict=True):
                results[r] = res
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{self.rate.add(sum(len(o[0]) for o in out)):.0f}")
        return results
