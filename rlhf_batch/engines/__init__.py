"""Generation engines other than the built-in sampler (rlhf_batch.sampler), behind small functions."""
