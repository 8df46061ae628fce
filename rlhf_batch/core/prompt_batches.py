"""Which prompts iteration K samples: pure selection math (no I/O).

With ``B = generate.prompts_per_iteration`` > 0, the prompt set (``n`` rows of the prompt file)
is read in epochs. Epoch ``e`` is one permutation of the rows, seeded by ``(seed, e)``; it holds
``n // B`` iterations, and iteration ``K`` takes positions ``[j * B, (j + 1) * B)`` of epoch
``K // (n // B)``'s permutation, with ``j = K % (n // B)``. The last ``n % B`` positions of an
epoch are not used (as a data loader with ``drop_last``); the next epoch is reshuffled, so no
row is left out for good. The order depends only on ``(n, B, seed)``: a run that goes straight
through, one killed and resumed, and one extended later with more iterations sample the same
prompts at the same iteration.

``B = 0``: every iteration takes every row in file order (epoch ``K``, positions ``[0, n)``).

The functions count batches (``iteration`` below): batch ``k`` is iteration ``k``'s until a
dynamic-sampling top-up round takes a batch of its own; from then on each iteration starts
after the last batch taken (rlhf_batch/data/topup.py), along the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptBatch:
    epoch: int
    start: int  # positions [start, stop) of the epoch's order
    stop: int


def iterations_per_epoch(n_prompts: int, per_iteration: int) -> int:
    """Iterations in one pass over the prompt set (1 when every iteration takes every prompt)."""
    _check(n_prompts, per_iteration)
    return 1 if per_iteration == 0 else n_prompts // per_iteration


def batch_for(iteration: int, n_prompts: int, per_iteration: int) -> PromptBatch:
    """The epoch and the positions iteration `iteration` takes."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    per_epoch = iterations_per_epoch(n_prompts, per_iteration)
    if per_iteration == 0:
        return PromptBatch(iteration, 0, n_prompts)
    j = iteration % per_epoch
    return PromptBatch(iteration // per_epoch, j * per_iteration, (j + 1) * per_iteration)


def epoch_order(n_prompts: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the rows 0..n-1 (int64 [n]), seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n_prompts)


def rows_for(iteration: int, n_prompts: int, per_iteration: int, seed: int) -> tuple[PromptBatch, list[int]]:
    """The batch iteration `iteration` takes and the prompt-file rows at its positions."""
    b = batch_for(iteration, n_prompts, per_iteration)
    if per_iteration == 0:
        return b, list(range(n_prompts))
    return b, epoch_order(n_prompts, seed, b.epoch)[b.start : b.stop].tolist()


def _check(n_prompts: int, per_iteration: int) -> None:
    if n_prompts < 1:
        raise ValueError(f"the prompt set is empty (n_prompts = {n_prompts})")
    if per_iteration < 0:
        raise ValueError(f"prompts_per_iteration must be >= 0, got {per_iteration}")
    if per_iteration > n_prompts:
        raise ValueError(
            f"prompts_per_iteration = {per_iteration} exceeds the {n_prompts} prompts of the set"
        )
