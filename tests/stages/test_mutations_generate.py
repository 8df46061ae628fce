"""Sampling and generate checked against independent numbers: plain transformers forward passes
of one unpadded row, log_softmax(logits / T) in float32. Prompts have mixed lengths, so a batch
holds left-padded rows; temperatures differ from 1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlhf_batch.engines.sampler import sample
from tests.stages.cli_helpers import read, small_prompts, stage, unpadded_logprobs

T = 0.7


@pytest.fixture(scope="module")
def model(tiny_model: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def test_sampler_logprobs_of_mixed_length_prompts_equal_an_unpadded_forward(model) -> None:  # noqa: ANN001
    # one batch of prompts of 1, 2, 5, 9 and 13 tokens: the short ones carry up to 12 pad tokens
    prompts = [[20 + i for i in range(n)] for n in (13, 1, 5, 2, 9)]
    out = sample(
        model, prompts, [11, 12, 13, 14, 15], max_new_tokens=6, temperature=T, pad_id=1, stop_ids={0}
    )
    checked = 0
    for p, (toks, lps, _) in zip(prompts, out, strict=True):
        assert len(toks) == len(lps) >= 1
        ref = unpadded_logprobs(model, p, toks, T)
        assert (torch.tensor(lps) - ref).abs().max() < 1e-5, (len(p), lps, ref.tolist())
        checked += len(toks)
    assert checked >= 5 * 5  # nearly every row ran its 6 steps (EOS is 1 token of 105)


def test_sampler_draws_from_the_tempered_distribution(model) -> None:  # noqa: ANN001
    """300 first tokens of one prompt (300 seeds) at T = 0.3. The stored log-prob of a draw is
    log p_T(token); drawn from p_T its mean is -H(p_T), drawn from softmax(logits) (the
    temperature ignored) it is the cross-entropy -sum p_1 log p_T, which is higher by
    KL(p_1 || p_T) + H(p_1) - H(p_T). Both are worked out from an independent forward pass."""
    prompt, temp, n = [30, 31, 32, 33], 0.3, 300
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()  # [V]
    log_pt, p1 = torch.log_softmax(logits / temp, -1), torch.softmax(logits, -1)  # [V]
    mean_t = float((log_pt.exp() * log_pt).sum())  # -H(p_T)
    std_t = float(((log_pt.exp() * (log_pt - mean_t) ** 2).sum()).sqrt())
    mean_1 = float((p1 * log_pt).sum())  # expected when the temperature is ignored
    se = std_t / math.sqrt(n)
    assert abs(mean_t - mean_1) > 8 * se  # the two hypotheses are far apart at this sample size
    out = sample(model, [prompt] * n, list(range(n)), max_new_tokens=1, temperature=temp, pad_id=1)
    drawn = torch.tensor([lps[0] for _, lps, _ in out])  # [n] stored behaviour log-probs
    assert (drawn - log_pt[torch.tensor([t[0] for t, _, _ in out])]).abs().max() < 1e-5
    assert abs(float(drawn.mean()) - mean_t) < 4 * se, (float(drawn.mean()), mean_t, mean_1)


def test_a_stop_token_on_the_last_allowed_step_is_stop_not_length(model) -> None:  # noqa: ANN001
    stops = set(range(model.config.vocab_size))
    # every token is a stop token, so every row stops at its first step; row 0 has a budget of
    # 1 token (the stop is on its last allowed step), row 1 of 3, row 2 of 1 with a long prompt
    out = sample(
        model,
        [[40, 41], [40, 41], [40, 41, 42, 43, 44]],
        [1, 2, 3],
        max_new_tokens=[1, 3, 1],
        temperature=T,
        stop_ids=stops,
        pad_id=1,
    )
    assert [(len(toks), reason) for toks, _, reason in out] == [(1, "stop")] * 3
    # one budget for all: the first step is the last one of every row
    out = sample(model, [[40, 41], [40]], [4, 5], max_new_tokens=1, temperature=T, stop_ids=stops, pad_id=1)
    assert [(len(toks), reason) for toks, _, reason in out] == [(1, "stop")] * 2
    # and a row that reaches its budget without a stop token is 'length'
    ((toks, _, reason),) = sample(
        model, [[40, 41]], [1], max_new_tokens=2, temperature=T, stop_ids=set(), pad_id=1
    )
    assert (len(toks), reason) == (2, "length")


@pytest.fixture
def mixed_prompts(tmp_path: Path) -> Path:
    """5 prompts of 1 to 14 characters (the tokenizer is char-level: as many tokens)."""
    path = tmp_path / "mixed.jsonl"
    texts = ["a", "bb=", "ccccc*", "d*4=dddd+x", "the long one!!"]
    path.write_text("".join(json.dumps({"id": f"m{i}", "prompt": s}) + "\n" for i, s in enumerate(texts)))
    return path


def test_generate_mixed_length_prompts_logprobs_equal_an_unpadded_forward(
    make_config,
    mixed_prompts: Path,
    model,  # noqa: ANN001
) -> None:
    # 5 prompts x G 4 = 20 rows, batches of 16 rows: the first batch mixes 4 prompt lengths
    path, cfg = make_config(generate={"prompts": str(mixed_prompts), "temperature": T, "batch_size": 16})
    stage(path, "generate")
    rows = read(cfg.run_dir, "rollouts").to_pylist()
    assert sorted({len(r["prompt_ids"]) for r in rows}) == [1, 3, 6, 10, 14]
    for r in rows:
        ref = unpadded_logprobs(model, r["prompt_ids"], r["response_ids"], T)
        assert (torch.tensor(r["behavior_logprobs"]) - ref).abs().max() < 1e-5, r["rollout_id"]


def test_the_samples_of_one_prompt_each_draw_their_own_randomness(make_config, tmp_path: Path) -> None:
    # at temperature 1 the tiny model is close to uniform over 105 tokens: two independent
    # 6-token samples coincide with probability ~1e-12, samples sharing one seed always do
    path, cfg = make_config(generate={"temperature": 1.0, "prompts": str(small_prompts(tmp_path))})
    stage(path, "generate")
    groups: dict[str, list[tuple[int, ...]]] = {}
    for r in read(cfg.run_dir, "rollouts").to_pylist():
        groups.setdefault(r["prompt_id"], []).append(tuple(r["response_ids"]))
    assert len(groups) == 4 and all(len(g) == 4 for g in groups.values())
    for pid, responses in groups.items():
        assert len(set(responses)) == 4, (pid, responses)
