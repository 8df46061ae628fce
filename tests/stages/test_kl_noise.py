"""KL noise never trains the policy: an all-zero task score with KL in the reward trains no row,
and a policy carried forward unchanged from the reference is the reference (KL exactly 0)."""

from pathlib import Path

import pyarrow as pa

from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.models.tiny import init_model
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import SCORES


def zero(*, responses: list[str], **_: object) -> list[float]:
    """A task that nothing solves (a Math-Verify reward on a model that never answers)."""
    return [0.0] * len(responses)


def scores(cfg, it: int) -> pa.Table:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "scores"), SCORES)


def test_defaults_put_no_kl_in_the_reward(make_config) -> None:
    _, cfg = make_config()
    assert cfg.score.kl_in_reward is False and cfg.train.kl_loss_coef == 0.0  # TRL beta 0, verl off


def test_all_zero_scores_with_kl_in_the_reward_train_no_row(make_config, tmp_path: Path) -> None:
    # a reference with other weights: kl_sum differs from row to row, so the KL-shaped rewards
    # 0 - 0.05 * kl_sum differ inside every group while every task score is 0
    ref = init_model(tmp_path / "ref", arch="qwen2", seed=7)
    path, cfg = make_config(
        iterations=2,
        ref_model=str(ref),
        score={"reward_functions": ["tests.stages.test_kl_noise:zero"], "kl_in_reward": True},
    )
    run_pipeline(path, ["in_process=true"], quiet=True)
    for it in (0, 1):
        s = scores(cfg, it)
        assert set(s["score"].to_pylist()) == {0.0}
        assert len(set(s["reward"].to_pylist())) > 1  # the KL term alone spreads the rewards
        m = manifests.manifest(layout.folder(cfg.run_dir, it, "advantages"))
        assert (
            m["rows"] == 0
            and m["counts"]["groups_dropped_zero_variance"] == m["counts"]["groups_total"] == 12
        )
        t = manifests.manifest(layout.folder(cfg.run_dir, it, "train"))
        assert t["optimizer"]["global_step"] == 0  # no optimizer step


def test_a_policy_carried_forward_from_the_reference_gets_kl_exactly_zero(make_config) -> None:
    path, cfg = make_config(
        iterations=3,
        score={"reward_functions": ["tests.stages.test_kl_noise:zero"], "kl_in_reward": True},
    )
    run_pipeline(path, ["in_process=true"], quiet=True)
    for it in (1, 2):  # iteration 1 starts from iter=0000/policy, a copy of the reference, 2 from its copy
        assert (layout.policy_dir(cfg.run_dir, it - 1) / "carried_from.json").is_file()
        s = scores(cfg, it)
        assert set(s["kl_sum"].to_pylist()) == {0.0}
        assert {x for row in s["kl"].to_pylist() for x in row} == {0.0}
