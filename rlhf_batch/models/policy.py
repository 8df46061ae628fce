"""The policy an iteration starts from: the configured model (with an initial adapter merged)
for iteration 0, else the policy train of the iteration before wrote; and the policy an
iteration's rollouts are sampled from, `max_staleness` iterations older (core/staleness.py)."""

from __future__ import annotations

from typing import Any

from rlhf_batch.config import Config
from rlhf_batch.core.staleness import sampling_start, staleness
from rlhf_batch.store import layout


def start_policy(cfg: Config, iteration: int) -> str:
    """The policy iteration `iteration` starts from: the configured model for iteration 0, else
    the policy train of the iteration before wrote (which must be complete)."""
    from rlhf_batch.errors import StageError
    from rlhf_batch.store.manifests import manifest
    from rlhf_batch.store.modeldir import check_base_weights, check_model_dir, removed_record

    _check_iteration(iteration)
    if iteration == 0:
        check_base_weights(cfg.run_dir, cfg.policy_model, "policy_model")
        if cfg.lora.init_adapter:
            from rlhf_batch.models.lora import initial_policy

            return initial_policy(cfg)  # the base with that adapter merged
        return str(check_model_dir(cfg.policy_model, "policy_model"))
    prev = layout.policy_dir(cfg.run_dir, iteration - 1)
    train_dir = layout.folder(cfg.run_dir, iteration - 1, layout.TRAIN)
    why = "" if manifest(train_dir) is not None else f"; {train_dir} is not complete"
    if not why and removed_record(prev) is not None:
        return str(prev)  # removed by keep_policies: stages that read it are complete (retention.py)
    if why or not prev.is_dir():
        raise StageError(
            f"iteration {iteration}: iteration {iteration - 1} has no trained policy ({prev}{why}); "
            f"run train --iter {iteration - 1} first"
        )
    return str(check_model_dir(str(prev), "policy"))


def sampling_policy(cfg: Config, iteration: int) -> str:
    """The policy iteration `iteration`'s rollouts are sampled from (generate and its top-up
    rounds, import): the start policy of iteration max(K - max_staleness, 0)."""
    _check_iteration(iteration)
    return start_policy(cfg, sampling_start(iteration, cfg.max_staleness))


def _check_iteration(iteration: int) -> None:
    from rlhf_batch.errors import StageError

    if iteration < 0:
        raise StageError(f"--iter must be >= 0, got {iteration}")


def sampled_by(cfg: Config, iteration: int) -> dict[str, Any]:
    """What a rollouts manifest records of its sampling policy: `policy_iteration`, the iteration
    whose train wrote it (-1: the initial policy), and `staleness` (0: lock-step)."""
    return {
        "policy_iteration": sampling_start(iteration, cfg.max_staleness) - 1,
        "staleness": staleness(iteration, cfg.max_staleness),
    }
