"""Stage 4, train (stage.py: the `Train` stage and what it reads, writes and records).

stage.py     the stage: identity, inputs, checks, the manifest
loop.py      the epochs' steps: plan, checkpoints, progress, live tracking
step.py      one GRPO optimizer step: micro-batch forward, loss (core/losses.py), metrics
parallel.py  the trainer's set-up: the policy in train mode, AdamW, DDP or FSDP2
save.py      checkpoints, the policy, the optimizer state, metrics.parquet
data.py      the advantages rows, the steps' micro-batches, the LR schedule's factor
schedule.py  the LR schedule's length, fixed once per run
carry.py     AdamW state and step count carried from iteration K-1
stats.py     per-rollout diagnostics (rollout_stats.parquet)
empty.py     no trainable row: the policy carried forward unchanged
"""
