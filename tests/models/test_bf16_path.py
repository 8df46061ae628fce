"""The bfloat16 path of every model stage, forced with `dtype = "bfloat16"` so it runs on every
CPU (on one without bf16 matrix units `auto` picks float32). Each result is checked against a
plain float32 forward of the same tokens, with tolerances that fit bfloat16: 8 significant bits,
so a logit of magnitude ~5 is off by up to ~0.02 and a log-prob by a few hundredths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM

from tests.stages.cli_helpers import manifest, read, stage, unpadded_logprobs

TEMPERATURE = 0.7
# bf16 against float32, per token: measured 0.0048 max, 0.0011 mean (float32 vs float32: 1e-6); a
# wrong temperature (1 for 0.7) is off by ~0.17
MAX_ABS, MAX_MEAN = 0.05, 0.01


def _float32_logprobs(model_dir: Path, rows: pa.Table) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [
        unpadded_logprobs(model, r["prompt_ids"], r["response_ids"], TEMPERATURE)
        for r in rows.select(["prompt_ids", "response_ids"]).to_pylist()
    ]


def _close(got: list[list[float]], want: list[torch.Tensor]) -> None:
    diff = torch.cat([(torch.tensor(g) - w).abs() for g, w in zip(got, want, strict=True)])  # [N]
    assert diff.numel() > 20
    assert float(diff.max()) < MAX_ABS and float(diff.mean()) < MAX_MEAN, (diff.max(), diff.mean())
    assert float(diff.max()) > 0  # it did run in bf16: float32 would agree to ~1e-6


def test_every_model_stage_runs_in_bfloat16(make_config, tiny_model: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref"  # the reference under another path, so score runs its forward
    shutil.copytree(tiny_model, ref)
    path, cfg = make_config(
        dtype="bfloat16",
        ref_model=str(ref),
        score={"reward_functions": ["rlhf_batch.rewards.demo:letter_count"], "kl_in_reward": True},
        generate={"temperature": TEMPERATURE},
        advantage={"drop_zero_variance": False},
        train={"lr": 1e-3, "autocast_bf16": True},
    )
    for name in ("generate", "score", "advantage", "train"):
        stage(path, name)
    rollouts, scores = read(cfg.run_dir, "rollouts"), read(cfg.run_dir, "scores")
    want = _float32_logprobs(tiny_model, rollouts)
    _close(rollouts["behavior_logprobs"].to_pylist(), want)  # generate: behaviour log-probs
    _close(scores["ref_logprobs"].to_pylist(), want)  # score: the reference's, at the temperature
    assert manifest(cfg.run_dir, "rollouts")["config"]["dtype"] == "bfloat16"
    # train: bf16 autocast over float32 master weights; the saved policy keeps the start's dtype,
    # is finite and moved (lr 1e-3 on a ~80k-parameter model)
    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    policy = Path(cfg.run_dir) / "iter=0000" / "policy"
    trained = AutoModelForCausalLM.from_pretrained(policy).state_dict()
    assert {t.dtype for t in trained.values()} == {t.dtype for t in start.values()}
    assert all(bool(torch.isfinite(t).all()) for t in trained.values())
    moved = max(float((trained[k].float() - start[k].float()).abs().max()) for k in start)
    assert moved > 1e-4
    assert manifest(cfg.run_dir, "train")["counts"]["steps"] >= 1
