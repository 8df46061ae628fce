"""Dynamic sampling (DAPO): top-up rounds of an iteration, and the order prompts are taken in.

With `advantage.min_groups = M` > 0, when the filters leave fewer than M informative groups
(groups that would get a training row: advantage's `groups_out`), `run` tops the iteration up
with round r = 1, 2, ... up to `advantage.max_topup_rounds`: generate and score of
`iter=K/topup=RR/{rollouts,scores}`, the same stages over the next batch of prompts of the
iteration's order. advantage of iteration K then reads round 0 and every complete top-up round
as one table. Each decision depends only on complete folders, so a killed `run` makes the same
decisions again and redoes only the missing parts.

Prompt order (the hook prompt batches plug into): `iteration_order` gives the order iteration K
takes prompts in and `batch_size` how many a round takes; today an iteration takes every
prompt of the set in file order, so a top-up round samples the whole set again. Round r takes
positions [r * B, (r + 1) * B) of the order, wrapping around the set; its sample indices
start at r * G (G = num_generations), so rollout ids `{iter}-{prompt_id}-{sample_idx}` stay
unique and stable, and a prompt drawn again joins its group with G more samples.
"""

from __future__ import annotations

from rlhf_batch.config import Config


def iteration_order(cfg: Config, n_prompts: int, iteration: int) -> list[int]:
    """Indices into the prompt set in the order iteration `iteration` takes them (file order)."""
    return list(range(n_prompts))


def batch_size(cfg: Config, n_prompts: int) -> int:
    """Prompts per round: the whole set (prompt batches will make this their batch size)."""
    return n_prompts


def round_prompts(cfg: Config, n_prompts: int, iteration: int, topup: int) -> list[int]:
    """Indices of the prompts round `topup` of iteration `iteration` samples (0: the iteration's own)."""
    order, b = iteration_order(cfg, n_prompts, iteration), batch_size(cfg, n_prompts)
    return [order[(topup * b + j) % n_prompts] for j in range(b)] if n_prompts else []


def sample_offset(cfg: Config, topup: int) -> int:
    """The first sample index of round `topup` (rollout ids stay unique across rounds)."""
    return topup * cfg.generate.num_generations
