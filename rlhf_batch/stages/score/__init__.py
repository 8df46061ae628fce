"""Stage 2, score (stage.py: the `Score` stage, its parts and its KL controller).

stage.py   the stage: identity, inputs, parts, the KL controller's state in the manifest
scorer.py  one part scored: reward functions, reward model, reference and teacher log-probs, KL
checks.py  the rollouts' token ids and the models' tokenizers checked before anything is scored
"""
