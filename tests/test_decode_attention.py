"""The sampler's decode attention (one query per row, batched matmuls) against transformers' SDPA
attention and against a plain forward of the sampled tokens. Real tiny models, no mocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlhf_batch.forward import response_logprobs
from rlhf_batch.models import load_model
from rlhf_batch.sampler import DECODE_ATTENTION, decode_attention, sample
from rlhf_batch.tiny import init_model


class Heads(torch.nn.Module):
    """What the attention interface reads from a module: 8 query heads over 2 key heads."""

    num_key_value_groups = 4
    is_causal = True


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=g).to(dtype)  # [b, H, 1, D]
    k = torch.randn(3, 2, 11, 16, generator=g).to(dtype)  # [b, KV, L, D]
    v = torch.randn(3, 2, 11, 16, generator=g).to(dtype)
    mask = torch.ones(3, 1, 1, 11, dtype=torch.bool)  # [b, 1, 1, L]
    mask[0, ..., :4] = False  # row 0 left-padded by 4, row 2 by 10 (one key left)
    mask[2, ..., :10] = False
    return q, k, v, mask


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_decode_attention_equals_sdpa(dtype: torch.dtype, tol: float) -> None:
    q, k, v, mask = _inputs(dtype)
    got, _ = decode_attention(Heads(), q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(Heads(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (3, 1, 8, 16)
    assert got.dtype == dtype
    assert float((got.float() - want.float()).abs().max()) < tol
    # a row with one key left attends only to it: its output is that key's value, per query head
    assert torch.allclose(got[2, 0].float(), v[2, :, 10].float().repeat_interleave(4, dim=0), atol=tol)


def test_decode_attention_masks_padding() -> None:
    q, k, v, mask = _inputs(torch.float32)
    got, _ = decode_attention(Heads(), q, k, v, mask, scaling=0.25)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, :4], v2[0, :, :4] = 100.0, -100.0  # change only the masked keys of row 0
    again, _ = decode_attention(Heads(), q, k2, v2, mask, scaling=0.25)
    assert torch.equal(got, again)
    unmasked, _ = decode_attention(Heads(), q, k2, v2, None, scaling=0.25)
    assert not torch.allclose(unmasked[0], got[0], atol=1e-3)


def test_an_additive_mask_equals_the_bool_one() -> None:
    q, k, v, mask = _inputs(torch.float32)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # [b, 1, 1, L]
    got, _ = decode_attention(Heads(), q, k, v, additive, scaling=0.25)
    want, _ = decode_attention(Heads(), q, k, v, mask, scaling=0.25)
    assert torch.allclose(got, want, atol=1e-6)


def test_soft_capping_goes_to_sdpa() -> None:
    q, k, v, mask = _inputs(torch.float32)
    with pytest.raises(ValueError, match="softcap"):  # transformers' SDPA refuses it
        decode_attention(Heads(), q, k, v, mask, scaling=0.25, softcap=30.0)


def test_prompts_go_to_sdpa() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 8 if i == 0 else 2, 5, 16, generator=g) for i in range(3))
    got, _ = decode_attention(Heads(), q, k, v, None, scaling=0.25, is_causal=True)
    want, _ = sdpa_attention_forward(Heads(), q, k, v, None, scaling=0.25, is_causal=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sample_decodes_with_it_and_keeps_the_forward_log_probs(tmp_path: Path, dtype: str) -> None:
    path = init_model(tmp_path / "m", arch="qwen2", seed=3)
    model = load_model(str(path), "policy", dtype=dtype)
    seen: list[tuple[int, str]] = []
    model.register_forward_pre_hook(
        lambda mod, args, kw: seen.append((kw["input_ids"].shape[1], mod.config._attn_implementation)),
        with_kwargs=True,
    )
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    out = sample(model, prompts, [1, 2, 3], max_new_tokens=6, pad_id=1)
    assert model.config._attn_implementation == "sdpa"  # put back
    assert seen[0] == (6, DECODE_ATTENTION) and len(seen) == 6  # prefill, then 5 decode forwards
    assert all(w == 1 and name == DECODE_ATTENTION for w, name in seen[1:])
    diffs = []
    with torch.inference_mode():
        for p, (toks, lps, _) in zip(prompts, out, strict=True):
            want, _, _ = response_logprobs(model, [p + toks], [len(p)], 1.0, pad_id=1)
            diffs.append((want[0] - torch.tensor(lps)).abs())
    d = torch.cat(diffs)
    # float32: the same numbers to rounding; bfloat16: within tests/test_bf16_path.py's tolerance
    assert float(d.max()) < (1e-5 if dtype == "float32" else 0.05)
