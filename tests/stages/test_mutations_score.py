"""score's reference log-probs at the configured temperature, and the temperature in the identity
of score and train: through the command line, checked against plain transformers forward passes."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.stages.cli_helpers import cli, read, small_prompts, stage, unpadded_logprobs

T = 0.7


def test_reference_logprobs_use_the_generate_temperature(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    # the same weights under another path: score runs a forward pass of the reference
    ref_dir = shutil.copytree(tiny_model, tmp_path / "ref_copy")
    path, cfg = make_config(
        generate={"temperature": T, "prompts": str(small_prompts(tmp_path))},
        ref_model=str(ref_dir),
        score={"reward_functions": ["rlhf_batch.rewards.demo:letter_count"], "kl_in_reward": True},
    )
    stage(path, "generate")
    stage(path, "score")
    rollouts, scores = read(cfg.run_dir, "rollouts").to_pylist(), read(cfg.run_dir, "scores").to_pylist()
    assert [r["rollout_id"] for r in rollouts] == [s["rollout_id"] for s in scores]
    ref_model = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    for r, s in zip(rollouts, scores, strict=True):
        want = unpadded_logprobs(ref_model, r["prompt_ids"], r["response_ids"], T)
        assert (torch.tensor(s["ref_logprobs"]) - want).abs().max() < 1e-5, r["rollout_id"]
        # same weights: the behaviour log-probs (KV-cached sampling) agree to float32 rounding
        assert (torch.tensor(s["kl"]).abs().max()) < 1e-5


def test_a_complete_score_or_train_refuses_another_temperature(make_config, tmp_path: Path) -> None:
    # zero-variance groups kept: the demo reward of a random model is mostly 0
    path, _ = make_config(
        generate={"temperature": T, "prompts": str(small_prompts(tmp_path))},
        advantage={"drop_zero_variance": False},
    )
    for name in ("generate", "score", "advantage", "train"):
        stage(path, name)
    for name in ("score", "train"):
        stage(path, name)  # same config: the complete stage is kept (exit 0)
        res = cli(name, path, "--iter", 0, "--quiet", "--set", "generate.temperature=0.9")
        assert res.exit_code != 0, (name, res.output)
        assert "temperature" in str(res.exception), (name, res.exception)
