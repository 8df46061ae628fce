"""The fast paths added for speed keep the numbers of the plain ones: shared prompts in score,
per-row budgets in the sampler, the LM-head chunk size. Real tiny models, no mocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_batch.engines.sampler import sample
from rlhf_batch.models.forward import (
    _prompt_chunks,
    _response_batches,
    batched_logprobs,
    can_share_prefix,
    default_chunk_size,
    response_logprobs,
    shared_prefix_logprobs,
)
from rlhf_batch.models.load import load_model
from rlhf_batch.models.tiny import init_model

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
# 7 rows over the 3 prompts, responses of 1..9 tokens (one empty)
ROWS = [
    (0, [20, 21]),
    (1, [22]),
    (0, [23, 24, 25, 26, 27, 28, 29, 30, 31]),
    (2, [32, 33, 34]),
    (1, []),
    (1, [35, 36, 37, 38]),
    (0, [39, 40, 41, 42, 43]),
]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = init_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, seed=3)
    return load_model(str(path), "policy", dtype="float32")


def plain(model, rows, temperature: float) -> list[torch.Tensor]:
    seqs = [PROMPTS[j] + r for j, r in rows]
    logp, mask, _ = response_logprobs(model, seqs, [len(PROMPTS[j]) for j, _ in rows], temperature, pad_id=1)
    return [logp[i][mask[i]] for i in range(len(rows))]


@pytest.mark.parametrize("max_tokens", [4, 16, 1000])
def test_shared_prompts_give_the_log_probs_of_full_sequences(model, max_tokens: int) -> None:
    assert can_share_prefix(model)
    with torch.inference_mode():
        got = shared_prefix_logprobs(
            model, PROMPTS, [r for _, r in ROWS], [j for j, _ in ROWS], 0.7, pad_id=1, max_tokens=max_tokens
        )
        want = plain(model, ROWS, 0.7)
    for g, w, (_, r) in zip(got, want, ROWS, strict=True):
        assert g.shape == (len(r),)
        assert torch.allclose(g, w, atol=1e-5, rtol=0)


def test_score_batched_logprobs_same_with_and_without_shared_prompts(model) -> None:
    prompt_ids = [PROMPTS[j] for j, _ in ROWS]
    responses = [r for _, r in ROWS]
    shared = batched_logprobs(model, prompt_ids, responses, 1.0, pad_id=1, max_tokens=64)
    distinct = [[90 + j] + p for j, p in enumerate(prompt_ids)]  # no two rows share a prompt now
    alone = [plain_one(model, p, r) for p, r in zip(prompt_ids, responses, strict=True)]
    assert batched_logprobs(model, distinct, responses, 1.0, pad_id=1, max_tokens=64)[4].shape == (0,)
    for s, a in zip(shared, alone, strict=True):
        assert s.shape == a.shape and (abs(s - a) < 1e-5).all()


def plain_one(model, p: list[int], r: list[int]):
    if not r:
        return torch.zeros(0).numpy()
    with torch.inference_mode():
        logp, _, _ = response_logprobs(model, [p + r], [len(p)], 1.0, pad_id=1)
    return logp[0].numpy()


def test_response_batches_respect_both_budgets() -> None:
    # r = [5, 1, 3, 0, 4], p = [2, 9, 2, 2, 2]; longest response first: rows 0 (5), 4 (4), 2 (3), 1 (1).
    # budget 10: [0] alone would allow 2 rows x 5 = 10 <= 10, then row 4: 2 x max(5, 4) = 10 ok;
    # row 2: 3 x 5 = 15 > 10 -> new batch [2], then row 1: 2 x 3 = 6 <= 10 but 2 x (3 + 9) = 24 <= 40 ok.
    assert _response_batches([5, 1, 3, 0, 4], [2, 9, 2, 2, 2], 10, max_padding=1.0) == [[0, 4], [2, 1]]
    # with padding <= 10% (the default): [0, 4] holds 5 + 4 = 9 real of 2 x 5 = 10 positions, 9 >= 0.9 x 10
    # -> kept; [2, 1] would hold 3 + 1 = 4 real of 2 x 3 = 6, 4 < 0.9 x 6 = 5.4 -> row 1 alone
    assert _response_batches([5, 1, 3, 0, 4], [2, 9, 2, 2, 2], 10) == [[0, 4], [2], [1]]
    # budget 3: every row alone except the cache bound 4 x 3 = 12 >= (1 + 9) for row 1 alone
    assert _response_batches([5, 1, 3, 0, 4], [2, 9, 2, 2, 2], 3) == [[0], [4], [2], [1]]


def test_prompt_chunks_keep_groups_whole() -> None:
    # prompts 0, 1, 2 of 3, 6, 1 tokens; at most 7 prompt tokens per chunk: {0} (3) + {1} (6) = 9 > 7
    # -> [rows of 0], then {1} + {2} = 7 -> [rows of 1 and 2]
    assert _prompt_chunks([0, 1, 0, 2, 1, 1, 0], [3, 6, 1], 7) == [[0, 2, 6], [1, 4, 5, 3]]


def test_default_chunk_size_gives_the_head_matmul_rows() -> None:
    # 512 rows unless 2^21 logits hold more: 2^21 / 32000 = 65 and 2^21 / 131072 = 16 -> 512;
    # 2^21 / 2048 = 1024 rows; 2^21 / 105 = 19972 -> capped at 4096
    assert default_chunk_size(32000) == 512
    assert default_chunk_size(131072) == 512
    assert default_chunk_size(2048) == 1024
    assert default_chunk_size(105) == 4096
    # any other head: 2^21 logits, 32 to 4096 rows: 65 at 32000, 16 -> 32 at 131072, 4096 at 105
    assert default_chunk_size(32000, linear=False) == 65
    assert default_chunk_size(131072, linear=False) == 32
    assert default_chunk_size(105, linear=False) == 4096


def test_sampler_per_row_budgets(tiny_model: Path) -> None:
    model = load_model(str(tiny_model), "policy", dtype="float32")
    out = sample(
        model, [[5, 6], [7, 8, 9], [10]], [1, 2, 3], max_new_tokens=[3, 1, 5], stop_ids=set(), pad_id=1
    )
    assert [len(t) for t, _, _ in out] == [3, 1, 5]
    assert [reason for _, _, reason in out] == ["length"] * 3
    # the same seeds with one shared budget give the same first tokens: a row's draws are its own
    same = sample(model, [[5, 6], [7, 8, 9], [10]], [1, 2, 3], max_new_tokens=5, stop_ids=set(), pad_id=1)
    for (a, la, _), (b, lb, _) in zip(out, same, strict=True):
        assert a == b[: len(a)]
        assert la == pytest.approx(lb[: len(la)], abs=1e-5)


def test_sampler_prefills_a_shared_prompt_once_and_each_row_samples_as_alone(tiny_model: Path) -> None:
    model = load_model(str(tiny_model), "policy", dtype="float32")
    a, b = [5, 6, 7], [8, 9]
    prompts, seeds = [a, b, a, a, b], [1, 2, 3, 4, 5]  # the rows of one prompt need not be adjacent
    widths: list[tuple[int, ...]] = []
    spy = model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        batch = sample(model, prompts, seeds, max_new_tokens=6, stop_ids=set(), pad_id=1)
    finally:
        spy.remove()
    assert widths[0] == (2, 3)  # the prefill: the 2 distinct prompts, left-padded to 3 tokens
    assert widths[1] == (5, 1)  # then every row decodes
    for p, seed, (toks, lps, _) in zip(prompts, seeds, batch, strict=True):
        ((alone, alone_lps, _),) = sample(model, [p], [seed], max_new_tokens=6, stop_ids=set(), pad_id=1)
        assert toks == alone and lps == pytest.approx(alone_lps, abs=1e-5)
    assert batch[0][0] != batch[2][0]  # the same prompt, other seeds: other samples (the check can fail)


def test_sampler_rows_keep_their_own_uniforms_across_blocks(tiny_model: Path) -> None:
    """Uniforms are drawn UNIFORM_BLOCK steps at a time per row: a row's tokens past the first
    block, beside rows that leave the batch early, are those it samples alone."""
    from rlhf_batch.engines.sampler import UNIFORM_BLOCK

    model = load_model(str(tiny_model), "policy", dtype="float32")
    long = UNIFORM_BLOCK + 6
    prompts, seeds = [[5, 6], [7, 8, 9], [10]], [1, 2, 3]
    batch = sample(model, prompts, seeds, max_new_tokens=[3, long, 2], stop_ids=set(), pad_id=1)
    alone = sample(model, [prompts[1]], [seeds[1]], max_new_tokens=long, stop_ids=set(), pad_id=1)
    assert len(batch[1][0]) == long
    assert batch[1][0] == alone[0][0]  # rows 0 and 2 left after 3 and 2 steps: uniforms re-indexed
    # another seed samples another sequence: the check can fail
    other = sample(model, [prompts[1]], [99], max_new_tokens=long, stop_ids=set(), pad_id=1)
    assert other[0][0] != alone[0][0]


def test_token_budget_batches_bound_the_padding() -> None:
    from rlhf_batch.core.batching import token_budget_batches

    # longest first: 10, 9 -> padded 2 x 10 = 20, real 19 >= 0.9 x 20; + 5 -> 3 x 10 = 30, real 24 < 27:
    # a new batch 5, 5 (10 >= 0.9 x 10), + 4 -> 3 x 5 = 15, real 14 >= 13.5
    assert token_budget_batches([10, 9, 5, 5, 4], 100, max_padding=0.1) == [[0, 1], [2, 3, 4]]
    assert token_budget_batches([10, 9, 5, 5, 4], 100) == [[0, 1, 2, 3, 4]]  # 5 x 10 = 50 <= 100


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("gemma2", {"final_logit_softcapping": 0.5, "head_dim": 8, "query_pre_attn_scalar": 8}),
        ("cohere", {"logit_scale": 0.25}),
        ("granite", {"logits_scaling": 3.0}),
    ],
)
def test_models_with_a_logit_transform_are_scored_in_chunks_like_their_own_forward(
    arch: str, extra: dict
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    seqs, p_lens = [[3, 4, 5, 6, 7], [8, 9, 10]], [2, 1]
    with torch.inference_mode():
        logp, mask, _ = response_logprobs(model, seqs, p_lens, 0.7, pad_id=0, chunk_size=2)
        # the reference: the model's own forward (its transform applied), one sequence at a time
        for i, (s, p) in enumerate(zip(seqs, p_lens, strict=True)):
            logits = model(input_ids=torch.tensor([s])).logits[0, :-1].float() / 0.7  # [L-1, V]
            want = logits.log_softmax(-1)[torch.arange(p - 1, len(s) - 1), torch.tensor(s[p:])]
            assert torch.allclose(logp[i][mask[i]], want, atol=1e-5, rtol=0), arch
            # and the transform matters here: the bare LM head gives other numbers
            bare = model.get_output_embeddings()(
                model.get_decoder()(input_ids=torch.tensor([s])).last_hidden_state
            )
            bare_lp = (bare[0, :-1] / 0.7).log_softmax(-1)[
                torch.arange(p - 1, len(s) - 1), torch.tensor(s[p:])
            ]
            assert (bare_lp - want).abs().max() > 1e-3, arch


def test_shared_prompts_in_bf16_stay_within_bf16_rounding_of_float32(tmp_path: Path) -> None:
    # the bf16 path (the CPU flash kernel's bf16 attention over prompt and response, merged) against
    # float32 full sequences: log-probs up to ~5 in magnitude, bf16 keeps 8 bits (relative 2^-8 =
    # 0.004 per rounding, a few roundings deep) -> within 2e-2; with the prompt part dropped, or the
    # response part not causal, this test measured 0.23 and 0.16.
    path = init_model(tmp_path / "m", arch="qwen2", seed=3)
    with torch.inference_mode():
        f32 = torch.cat(plain(load_model(str(path), "policy", dtype="float32"), ROWS, 0.7))
        got = shared_prefix_logprobs(
            load_model(str(path), "policy", dtype="bfloat16"),
            PROMPTS,
            [r for _, r in ROWS],
            [j for j, _ in ROWS],
            0.7,
            pad_id=1,
            max_tokens=16,
        )
    assert float((torch.cat(got) - f32).abs().max()) < 2e-2
