"""L3, models: loading (models/load.py), attention, forward passes and log-probs, LoRA,
checkpoints and optimizer state, the policy an iteration starts from, tiny local models."""
