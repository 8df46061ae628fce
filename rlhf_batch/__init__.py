"""rlhf-batch: an offline, staged pipeline for RL post-training of causal language models."""

__version__ = "0.1.0"
