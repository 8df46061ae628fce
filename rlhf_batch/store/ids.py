"""The stable ids of the rollouts schema, and the per-row seed derived from them."""

from __future__ import annotations

import hashlib


def prompt_hash(text: str) -> str:
    """A prompt's id when the data gives none: the first 16 hex digits of its sha256."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rollout_id(iteration: int, prompt_id: str, sample_idx: int) -> str:
    return f"{iteration:04d}-{prompt_id}-{sample_idx}"


def row_seed(seed: int, rid: str) -> int:
    """The seed of one rollout's own random generator (independent of its batch)."""
    return int(hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest()[:15], 16)
