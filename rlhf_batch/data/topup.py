"""Dynamic sampling (DAPO): top-up rounds of an iteration, and the order prompts are taken in.

With `advantage.min_groups = M` > 0, when the filters leave fewer than M informative groups
(groups that would get a training row: advantage's `groups_out`), `run` tops the iteration up
with round r = 1, 2, ... up to `advantage.max_topup_rounds`: generate and score of
`iter=K/topup=RR/{rollouts,scores}`, the same stages over further prompts of the run's prompt
order. advantage of iteration K then reads round 0 and every complete top-up round as one
table. Each decision depends only on complete folders, so a killed `run` makes the same
decisions again and redoes only the missing parts.

Prompt order. With `generate.prompts_per_iteration = B` > 0 the run reads the prompt set as
one sequence of batches (core/prompt_batches.py: batch k is positions [j B, (j + 1) B) of
epoch k // (n // B)'s seeded permutation, j = k mod (n // B)). Every round of every iteration
takes the next batch of that sequence, as DAPO keeps pulling batches from its data loader:
round r of iteration K takes batch `first_batch(K) + r`, and iteration K + 1 starts after the
last batch iteration K took (its round 0 and its complete top-up rounds), so batches taken by
top-up rounds (or read by generate.prompt_filter_refill: curriculum.py) are skipped by the
next iterations, never sampled twice in one pass. Without
top-up rounds batch k is iteration k's, as before. Each round's rollouts manifest records its
batch index, epoch and positions (`prompt_batch`), and `first_batch(K)` is worked out from
iteration K - 1's manifests alone: the order is the same whether the run went straight
through, was killed and resumed (anywhere, a top-up round included) or was extended later.
Inside one epoch a round's prompts are new to the iteration; a round that starts the next
epoch draws from its reshuffled permutation, where a prompt of the iteration's earlier rounds
can come again (it then joins its group with G more samples). `epochs = E` still sizes the run
as E * (n // B) iterations, so with top-up rounds the run reads further than E passes.

With B = 0 (every prompt, every iteration) there are no further prompts: a top-up round
samples the whole set again, in file order.

Round r's sample indices start at r * G (G = num_generations), so rollout ids
`{iter}-{prompt_id}-{sample_idx}` stay unique and stable over the rounds whatever prompts they
hold.
"""

from __future__ import annotations

from rlhf_batch.config import Config
from rlhf_batch.store import layout, manifests


def batch_index(cfg: Config, iteration: int, topup: int) -> int:
    """The batch of the prompt order round `topup` of iteration `iteration` takes (with B = 0,
    the iteration: every round takes every prompt)."""
    if cfg.generate.prompts_per_iteration == 0:
        return iteration
    return first_batch(cfg.run_dir, iteration) + topup + refilled(cfg.run_dir, iteration, topup)


def first_batch(run_dir: str, iteration: int) -> int:
    """The batch iteration `iteration`'s round 0 takes: one past the last batch the iteration
    before took, from its rollouts manifests (the batch its round 0 records, plus one per
    complete top-up round). An iteration whose manifest records no batch (imported rollouts)
    counts as one batch and the count goes on from the iteration before it."""
    after = 0
    for it in range(iteration - 1, -1, -1):
        rounds = rounds_taken(run_dir, it)
        after += 1 + rounds + refilled(run_dir, it, rounds + 1)
        m = manifests.manifest(layout.folder(run_dir, it, layout.ROLLOUTS)) or {}
        recorded = (m.get("prompt_batch") or {}).get("batch")
        if isinstance(recorded, int):
            return recorded + after
    return after


def refilled(run_dir: str, iteration: int, rounds: int) -> int:
    """The batches the prompt filter's refill read (curriculum.py) in rounds 0..rounds-1 of
    `iteration`: each counts as taken."""
    n = 0
    for r in range(rounds):
        m = manifests.manifest(layout.folder(run_dir, iteration, layout.ROLLOUTS, r)) or {}
        n += len((m.get("prompt_batch") or {}).get("refill") or [])
    return n


def rounds_taken(run_dir: str, iteration: int) -> int:
    """The top-up rounds 1, 2, ... of iteration `iteration` with complete rollouts (up to the
    first missing): the batches it took beyond its own."""
    r = 0
    while manifests.manifest(layout.folder(run_dir, iteration, layout.ROLLOUTS, r + 1)) is not None:
        r += 1
    return r


def sample_offset(cfg: Config, topup: int) -> int:
    """The first sample index of round `topup` (rollout ids stay unique across rounds)."""
    return topup * cfg.generate.num_generations
