"""advantage.estimator = "opd" end to end on real Parquet and real tiny models: score with a
teacher -> advantage opd (per-token advantages) -> train on them."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlhf_batch.data.demo import write_prompts
from rlhf_batch.errors import ConfigError, SchemaError
from rlhf_batch.models.tiny import init_model
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from tests.stages.test_score import write_rollouts


def _table(cfg, folder: str) -> dict[str, dict]:  # noqa: ANN001
    """rollout_id -> row, read straight from the folder's Parquet parts (no stage reader)."""
    sdir = layout.folder(cfg.run_dir, 0, folder)
    rows = [r for p in sorted(sdir.glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    return {r["rollout_id"]: r for r in rows}


@pytest.fixture
def teacher(tmp_path):  # same tokenizer, other weights: a real teacher signal
    return init_model(tmp_path / "teacher", arch="qwen2", seed=5)


def test_opd_stores_teacher_minus_behaviour_per_token_and_trains(make_config, teacher) -> None:
    _, cfg = make_config(
        score={"teacher_model": str(teacher)}, advantage={"estimator": "opd", "opd_baseline": "none"}
    )
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    m = run_stage("advantage", cfg, 0, quiet=True)
    rollouts, scores, adv = _table(cfg, "rollouts"), _table(cfg, "scores"), _table(cfg, "advantages")
    # every group is kept (no zero-variance filter under opd): all 12 rollouts train
    assert m["counts"]["groups_dropped_zero_variance"] == 0 and len(adv) == 12
    for rid, row in adv.items():
        t = np.array(scores[rid]["teacher_logprobs"], np.float32)
        b = np.array(rollouts[rid]["behavior_logprobs"], np.float32)
        want = t - b  # float32 subtraction, worked here from the two stages' columns
        got = np.array(row["token_advantages"], np.float32)
        assert got.shape == want.shape and np.array_equal(got, want)
        assert np.abs(want).max() > 1e-3  # another model: a real signal
    run_stage("train", cfg, 0, quiet=True)
    metrics = pq.read_table(layout.folder(cfg.run_dir, 0, "train") / "metrics.parquet").to_pylist()
    # every row ran (none is idle: each has a non-zero token advantage), the loss is finite
    assert sum(r["sequences"] for r in metrics) == 12 and all(np.isfinite(r["loss"]) for r in metrics)


def test_opd_baseline_mean_subtracts_the_iterations_mean_token_difference(make_config, teacher) -> None:
    """The default baseline: one constant per iteration, the mean of teacher - behaviour over all
    response tokens of the scored rollouts (here all 12), so the stored advantages average 0."""
    _, cfg = make_config(score={"teacher_model": str(teacher)}, advantage={"estimator": "opd"})
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    run_stage("advantage", cfg, 0, quiet=True)
    rollouts, scores, adv = _table(cfg, "rollouts"), _table(cfg, "scores"), _table(cfg, "advantages")
    diffs = {
        rid: np.array(scores[rid]["teacher_logprobs"], np.float64)
        - np.array(r["behavior_logprobs"], np.float64)
        for rid, r in rollouts.items()
    }
    c = np.concatenate(list(diffs.values())).mean()  # sum over every token / number of tokens
    assert abs(c) > 0.1  # the raw signal is far from centred: another model's log-probs
    for rid, row in adv.items():
        assert row["token_advantages"] == pytest.approx((diffs[rid] - c).tolist(), abs=1e-5)
    assert abs(np.concatenate([row["token_advantages"] for row in adv.values()]).mean()) < 1e-5


def test_opd_scale_batch_divides_by_the_batch_std(make_config, teacher) -> None:
    """opd's group part with advantage.scale = "batch": (r - group mean) / (std of every reward of
    the iteration, ddof 1 + eps), as grpo's; it divided by eps alone before (no batch std was
    computed for opd)."""
    _, cfg = make_config(
        score={"teacher_model": str(teacher)}, advantage={"estimator": "opd", "scale": "batch"}
    )
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    run_stage("advantage", cfg, 0, quiet=True)
    scores, adv = _table(cfg, "scores"), _table(cfg, "advantages")
    rewards = np.array([r["reward"] for r in scores.values()], np.float64)
    batch_std = rewards.std(ddof=1)  # over all 12 rewards, around the batch mean
    assert batch_std > 0.01
    groups: dict[str, list[float]] = {}
    for r in scores.values():
        groups.setdefault(r["prompt_id"], []).append(r["reward"])
    for rid, row in adv.items():
        g = np.array(groups[row["prompt_id"]], np.float64)
        want = 0.0 if g.min() == g.max() else (scores[rid]["reward"] - g.mean()) / (batch_std + 1e-6)
        assert row["advantage"] == pytest.approx(want, abs=1e-5)


def test_opd_task_weight_adds_the_grpo_advantage(make_config, teacher) -> None:
    _, cfg = make_config(
        score={"teacher_model": str(teacher)},
        advantage={"estimator": "opd", "opd_task_weight": 0.5, "opd_baseline": "none"},
    )
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    run_stage("advantage", cfg, 0, quiet=True)
    rollouts, scores, adv = _table(cfg, "rollouts"), _table(cfg, "scores"), _table(cfg, "advantages")
    groups: dict[str, list[float]] = {}
    for r in scores.values():
        groups.setdefault(r["prompt_id"], []).append(r["reward"])
    for rid, row in adv.items():
        rewards = np.array(groups[row["prompt_id"]], np.float64)
        std = rewards.std(ddof=1)  # grpo: (r - mean) / (std + 1e-6), 0 for a constant group
        g = 0.0 if rewards.min() == rewards.max() else (scores[rid]["reward"] - rewards.mean()) / (std + 1e-6)
        t = np.array(scores[rid]["teacher_logprobs"], np.float64)
        b = np.array(rollouts[rid]["behavior_logprobs"], np.float64)
        assert row["advantage"] == pytest.approx(g, abs=1e-6)
        assert row["token_advantages"] == pytest.approx((t - b + 0.5 * g).tolist(), abs=1e-6)


def test_opd_needs_a_teacher_and_its_column(make_config, teacher) -> None:
    with pytest.raises(ConfigError, match=r"'advantage.estimator' = 'opd' needs score.teacher_model") as e:
        make_config(advantage={"estimator": "opd"})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"'advantage.opd_task_weight' is used only with"):
        make_config(advantage={"opd_task_weight": 1.0})
    _, plain = make_config()  # scored without a teacher, then opd asked for
    write_rollouts(plain)
    run_stage("score", plain, 0, quiet=True)
    _, cfg = make_config(score={"teacher_model": str(teacher)}, advantage={"estimator": "opd"})
    with pytest.raises(SchemaError, match=r"scores/part-.*missing column 'teacher_logprobs'"):
        run_stage("advantage", cfg, 0, quiet=True)
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages")) is None


def test_other_estimators_write_no_token_column_and_the_same_identity(make_config, teacher) -> None:
    _, cfg = make_config(score={"teacher_model": str(teacher)})
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    m = run_stage("advantage", cfg, 0, quiet=True)
    sdir = layout.folder(cfg.run_dir, 0, "advantages")
    assert "token_advantages" not in pq.read_schema(next(sdir.glob("part-*.parquet"))).names
    assert "opd_task_weight" not in m["config"]["advantage"]


def test_opd_on_multi_turn_rows_is_over_the_sampled_tokens(make_config, teacher, tmp_path) -> None:
    """Multi-turn rows: the baseline, the per-token advantages and the reverse KL are over the
    tokens the policy sampled (loss_mask 1). The environment's tokens carry behaviour log-prob
    0.0, so counting them moved the baseline far off (and gave every sampled token one sign)."""
    hidden = write_prompts(tmp_path / "hidden.jsonl", 6, seed=0, hidden=True)
    _, cfg = make_config(
        generate={
            "prompts": str(hidden),
            "environment": "rlhf_batch.envs.demo:ask_letter",
            "max_turns": 2,
            "num_generations": 2,
            "prompts_per_part": 3,
        },
        score={"teacher_model": str(teacher), "reward_functions": ["rlhf_batch.rewards.demo:ask_letter"]},
        advantage={"estimator": "opd"},
    )
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)
    m = run_stage("advantage", cfg, 0, quiet=True)
    rollouts, scores, adv = _table(cfg, "rollouts"), _table(cfg, "scores"), _table(cfg, "advantages")
    diffs, masks = {}, {}
    for rid, r in rollouts.items():
        diffs[rid] = np.array(scores[rid]["teacher_logprobs"], np.float64) - np.array(
            r["behavior_logprobs"], np.float64
        )
        masks[rid] = np.array(r["loss_mask"], bool)
    every = np.concatenate(list(diffs.values()))
    sampled = np.concatenate([diffs[rid][masks[rid]] for rid in rollouts])  # rewards: none is null here
    assert all(s["reward"] is not None for s in scores.values())
    assert len(sampled) < len(every)  # the environment answered: tokens of mask 0
    c = sampled.sum() / len(sampled)  # the mean over the sampled tokens, worked out here
    assert abs(c - every.mean()) > 0.05  # counting the environment's tokens moves it
    assert m["opd_baseline"] == pytest.approx(c, abs=1e-9)
    assert m["opd_reverse_kl"] == pytest.approx(-c, abs=1e-9)
    assert m["opd_sampled_tokens"] == len(sampled)
    assert len(adv) == len(rollouts)
    for rid, row in adv.items():
        want = np.where(masks[rid], diffs[rid] - c, 0.0)  # the environment's tokens: exactly 0
        got = np.array(row["token_advantages"], np.float64)
        assert got == pytest.approx(want, abs=1e-5)
        assert (got[~masks[rid]] == 0).all()
    run_stage("train", cfg, 0, quiet=True)
    metrics = pq.read_table(layout.folder(cfg.run_dir, 0, "train") / "metrics.parquet").to_pylist()
    assert all(np.isfinite(r["loss"]) for r in metrics)


def test_opd_baseline_leaves_out_rollouts_whose_reward_is_null(make_config, teacher) -> None:
    """Rows that cannot be scored (null reward) are not trained on, and their tokens are not in
    the baseline either: the mean is over the scored rollouts' tokens only."""

    def unscorable(rows: list[dict]) -> None:  # letter_count gives no reward without a letter
        for r in rows[:3]:
            r["letter"] = ""

    _, cfg = make_config(
        score={"teacher_model": str(teacher)}, advantage={"estimator": "opd", "min_group_size": 1}
    )
    write_rollouts(cfg, edit=unscorable)
    run_stage("score", cfg, 0, quiet=True)
    m = run_stage("advantage", cfg, 0, quiet=True)
    rollouts, scores, adv = _table(cfg, "rollouts"), _table(cfg, "scores"), _table(cfg, "advantages")
    scored = [rid for rid, s in scores.items() if s["reward"] is not None]
    assert len(scored) == 9 and set(adv) == set(scored)
    diffs = {
        rid: np.array(scores[rid]["teacher_logprobs"], np.float64)
        - np.array(rollouts[rid]["behavior_logprobs"], np.float64)
        for rid in rollouts
    }
    c = np.concatenate([diffs[rid] for rid in scored]).mean()  # the 9 scored rollouts' tokens
    every = np.concatenate(list(diffs.values())).mean()  # all 12: what counting the others gives
    assert abs(c - every) > 1e-3
    assert m["opd_baseline"] == pytest.approx(c, abs=1e-9)
    for rid, row in adv.items():
        assert row["token_advantages"] == pytest.approx((diffs[rid] - c).tolist(), abs=1e-5)
