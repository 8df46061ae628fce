"""Attention as batched matmuls (`rlhf_batch.models.attention`) against transformers' SDPA attention, a
float64 softmax(Q K^T) V written out here, and, in the sampler, a plain forward of the sampled
tokens. Real tiny models, no mocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlhf_batch.engines.sampler import sample
from rlhf_batch.models import attention
from rlhf_batch.models.attention import MATMUL_ATTENTION, matmul_attention
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.models.tiny import init_model
from rlhf_batch.runtime import device

decode_attention = matmul_attention  # one query per row: the decode steps' route


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
    assert model.config._attn_implementation == MATMUL_ATTENTION  # load_model's choice
    seen: list[tuple[int, str]] = []
    model.register_forward_pre_hook(
        lambda mod, args, kw: seen.append((kw["input_ids"].shape[1], mod.config._attn_implementation)),
        with_kwargs=True,
    )
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    out = sample(model, prompts, [1, 2, 3], max_new_tokens=6, pad_id=1)
    assert seen[0] == (6, MATMUL_ATTENTION) and len(seen) == 6  # prefill, then 5 decode forwards
    assert all(w == 1 and name == MATMUL_ATTENTION for w, name in seen[1:])
    diffs = []
    with torch.inference_mode():
        for p, (toks, lps, _) in zip(prompts, out, strict=True):
            want, _, _ = response_logprobs(model, [p + toks], [len(p)], 1.0, pad_id=1)
            diffs.append((want[0] - torch.tensor(lps)).abs())
    d = torch.cat(diffs)
    # float32: the same numbers to rounding; bfloat16: within tests/test_bf16_path.py's tolerance
    assert float(d.max()) < (1e-5 if dtype == "float32" else 0.05)


def test_sample_lends_it_to_a_model_loaded_elsewhere(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        init_model(tmp_path / "m", seed=4), attn_implementation="sdpa"
    )
    seen: list[str] = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(mod.config._attn_implementation))
    sample(model, [[5, 6, 7]], [1], max_new_tokens=3, pad_id=1)
    assert seen == [MATMUL_ATTENTION] * 3
    assert model.config._attn_implementation == "sdpa"  # put back


# ---------------------------------------------------------------- longer queries (prompts, train, score)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 softmax(scale Q K^T, masked where `keep` [b or 1, 1, q, L] is False) V -> [b, q, H, D];
    key head j serves query heads j * H / KV ... (j + 1) * H / KV - 1."""
    rep = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))  # [b, H, L, D]
    s = scale * q.double() @ k64.transpose(-1, -2)  # [b, H, q, L]
    s = s.masked_fill(~keep, float("-inf"))
    return (s.softmax(-1) @ v64).transpose(1, 2)  # [b, q, H, D]


def _qkv(b: int, q: int, length: int, seed: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, 8, q, 16), (b, 2, length, 16), (b, 2, length, 16)]  # H 8 over KV 2
    return tuple(torch.randn(s, generator=g).bfloat16().requires_grad_(grad) for s in shapes)


def test_causal_bf16_prompts_match_sdpa_and_the_float64_reference_with_gradients() -> None:
    q, k, v = _qkv(3, 12, 12, seed=5, grad=True)
    heads = Heads().train()
    got, _ = matmul_attention(heads, q, k, v, None, scaling=0.25)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]  # [1, 1, q, L]
    want = _reference(q, k, v, causal, 0.25)
    assert got.shape == (3, 12, 8, 16) and got.dtype == torch.bfloat16
    # bf16 inputs; outputs rounded to bf16 (relative step 2^-8) after bf16 probabilities
    assert float((got.detach().double() - want.detach()).abs().max()) < 3e-2
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    grads = torch.autograd.grad((got.float() * w.float()).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * w.double()).sum(), (q, k, v))
    sdpa, _ = sdpa_attention_forward(heads, q, k, v, None, scaling=0.25)
    sdpa_grads = torch.autograd.grad((sdpa.float() * w.float()).sum(), (q, k, v))
    for a, r, s in zip(grads, ref_grads, sdpa_grads, strict=True):
        scale = float(r.abs().max())
        assert float((a.double() - r).abs().max()) < 0.03 * scale
        assert float((a.double() - s.double()).abs().max()) < 0.03 * scale


def test_masked_bf16_queries_after_a_cached_prompt_match_the_reference() -> None:
    # shared-prompt scoring: 5 response queries after a prompt of 7, row 0's prompt left-padded by 3
    q, k, v = _qkv(2, 5, 12, seed=7)
    keep = torch.ones(2, 1, 5, 12, dtype=torch.bool).tril(7)  # query i sees keys 0 .. 7 + i
    keep[0, ..., :3] = False
    got, _ = matmul_attention(Heads(), q, k, v, keep, scaling=0.25)
    want = _reference(q, k, v, keep, 0.25)
    assert float((got.double() - want).abs().max()) < 3e-2
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(
        ~keep, torch.finfo(torch.bfloat16).min
    )
    again, _ = matmul_attention(Heads(), q, k, v, additive, scaling=0.25)
    assert torch.equal(got, again)
    # a float32 additive mask (its lowest value is -inf once in bf16): the same, and a row with
    # every key masked stays finite
    additive32 = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    additive32[1, ..., 2, :] = torch.finfo(torch.float32).min
    again, _ = matmul_attention(Heads(), q, k, v, additive32, scaling=0.25)
    assert torch.equal(got[0], again[0]) and bool(torch.isfinite(again).all())


def test_a_row_with_every_key_masked_stays_finite() -> None:
    q, k, v = _qkv(2, 4, 6, seed=8)
    keep = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    keep[1] = False  # a pad row of a left-padded prompt: its output is never used, but must not be NaN
    got, _ = matmul_attention(Heads(), q, k, v, keep, scaling=0.25)
    assert bool(torch.isfinite(got).all())
    want = _reference(q[:1], k[:1], v[:1], keep[:1], 0.25)
    assert float((got[:1].double() - want).abs().max()) < 3e-2


def test_what_it_does_not_take_goes_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(2, 6, 6, seed=9)
    sdpa, _ = sdpa_attention_forward(Heads(), q, k, v, None, scaling=0.25)
    ours, _ = matmul_attention(Heads(), q, k, v, None, scaling=0.25)
    assert not torch.equal(ours, sdpa)  # bf16 prompts within the bound: the matmul route
    monkeypatch.setattr(attention, "MAX_SCORES", 2 * 8 * 6 * 6 - 1)  # one element over the bound
    over, _ = matmul_attention(Heads(), q, k, v, None, scaling=0.25)
    assert torch.equal(over, sdpa)
    monkeypatch.undo()
    per_head = torch.ones(2, 8, 6, 6, dtype=torch.bool).tril()  # a mask per head
    got, _ = matmul_attention(Heads(), q, k, v, per_head, scaling=0.25)
    want, _ = sdpa_attention_forward(Heads(), q, k, v, per_head, scaling=0.25)
    assert torch.equal(got, want)
    heads = Heads().train()
    torch.manual_seed(0)
    dropped, _ = matmul_attention(heads, q, k, v, None, dropout=0.5, scaling=0.25)
    torch.manual_seed(0)
    want, _ = sdpa_attention_forward(heads, q, k, v, None, dropout=0.5, scaling=0.25)
    assert torch.equal(dropped, want)


def test_without_autograd_a_call_over_the_bound_runs_in_slices_of_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device, "cpu_has_amx", lambda: False)  # on AMX such calls go to SDPA
    q, k, v = _qkv(5, 5, 12, seed=11)  # 5 rows of [8 heads, 5 queries, 12 keys] = 480 each
    keep = torch.ones(5, 1, 5, 12, dtype=torch.bool).tril(7)
    for r in range(5):
        keep[r, ..., : r + 1] = False  # a different left padding per row: the mask is sliced with them
    with torch.no_grad():
        whole, _ = matmul_attention(Heads(), q, k, v, keep, scaling=0.25)
        monkeypatch.setattr(attention, "MAX_SCORES", 2 * 480)  # two rows a call: slices of 2, 2, 1
        sliced, _ = matmul_attention(Heads(), q, k, v, keep, scaling=0.25)
        monkeypatch.setattr(attention, "MAX_SCORES", 479)  # not even one row: SDPA
        one_row_over, _ = matmul_attention(Heads(), q, k, v, keep, scaling=0.25)
    assert torch.equal(sliced, whole)
    want, _ = sdpa_attention_forward(Heads(), q, k, v, keep, scaling=0.25)
    assert torch.equal(one_row_over, want)
    assert float((whole.double() - _reference(q, k, v, keep, 0.25)).abs().max()) < 3e-2


@pytest.mark.parametrize("amx", [False, True])
def test_on_a_cpu_with_amx_prompts_without_autograd_go_to_sdpa(
    monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    monkeypatch.setattr(device, "cpu_has_amx", lambda: amx)
    fits, routes = attention._rows_per_call, []  # rows per call of each call; 0 = SDPA
    monkeypatch.setattr(attention, "_rows_per_call", lambda *a: routes.append(fits(*a)) or routes[-1])
    for q, length, masked in [(9, 9, False), (6, 14, True)]:  # a causal prompt; queries after a cache
        qq, k, v = _qkv(2, q, length, seed=q)
        keep = torch.ones(2, 1, q, length, dtype=torch.bool).tril(length - q)
        with torch.no_grad():
            got, _ = matmul_attention(Heads(), qq, k, v, keep if masked else None, scaling=0.25)
            sdpa, _ = sdpa_attention_forward(Heads(), qq, k, v, keep if masked else None, scaling=0.25)
        assert routes[-1] == (0 if amx else 2), (q, masked)
        if amx:
            assert torch.equal(got, sdpa)
        assert float((got.double() - _reference(qq, k, v, keep, 0.25)).abs().max()) < 3e-2
    qq, k, v = _qkv(2, 9, 9, seed=1, grad=True)  # under autograd: the matmul route on any CPU
    matmul_attention(Heads(), qq, k, v, None, scaling=0.25)
    assert routes[-1] == 2
    with torch.no_grad():  # one query per row (decode): the matmul route on any CPU
        matmul_attention(Heads(), *_qkv(2, 1, 9, seed=2), None)
    assert routes[-1] == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "autocast"])  # bf16 weights; float32 ones under autocast
def test_a_bf16_model_scores_and_trains_through_it_as_through_sdpa(tmp_path: Path, dtype: str) -> None:
    path = init_model(tmp_path / "m", seed=10)
    seqs, plens = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]], [3, 2]
    routes: list[bool] = []
    fits = attention._rows_per_call

    def run(impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        model = load_model(str(path), "policy", dtype="float32" if dtype == "autocast" else dtype)
        model.config._attn_implementation = impl
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
            lp, mask, _ = response_logprobs(model, seqs, plens, 1.0, pad_id=1)
        lp[mask].float().sum().backward()
        return lp.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float()

    with pytest.MonkeyPatch.context() as mp:  # record the route each call takes
        mp.setattr(attention, "_rows_per_call", lambda *a: routes.append(fits(*a)) or routes[-1])
        lp, grad = run(MATMUL_ATTENTION)
    assert routes and all(routes)  # every layer's call took the matmul route (bf16 or autocast)
    lp_sdpa, grad_sdpa = run("sdpa")
    assert float((lp - lp_sdpa).abs().max()) < 0.05  # tests/test_bf16_path.py's tolerance
    assert float((grad - grad_sdpa).abs().max()) < 0.05 * float(grad_sdpa.abs().max())


# ---------------------------------------------------------------- responses after shared prompts


@pytest.mark.parametrize("fused", [True, False])
def test_attend_with_lse_by_hand(fused: bool) -> None:
    # one head, D = 2, scale 1; query (1, 0) against keys (0, 0) and (ln 3, 0): scores 0 and ln 3,
    # softmax weights 1/4 and 3/4, normaliser ln(1 + 3) = ln 4; values 1 and 5 (first component)
    # -> output 1/4 * 1 + 3/4 * 5 = 4. Causal with 2 queries: the first sees key 0 alone -> value
    # 1, normaliser ln e^(q0 . k0) = 0.
    q = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])  # [1, 1, 2, 2]
    k = torch.tensor([[[[0.0, 0.0], [float(torch.log(torch.tensor(3.0))), 0.0]]]])
    v = torch.tensor([[[[1.0, 0.0], [5.0, 0.0]]]])
    out, lse = attention.attend_with_lse(q, k, v, False, 1.0, fused=fused)
    assert out[0, 0, :, 0].tolist() == pytest.approx([4.0, 4.0], abs=1e-6)
    assert lse[0, 0].tolist() == pytest.approx([1.3862944, 1.3862944], abs=1e-6)  # ln 4
    out, lse = attention.attend_with_lse(q, k, v, True, 1.0, fused=fused)
    assert out[0, 0, :, 0].tolist() == pytest.approx([1.0, 4.0], abs=1e-6)
    assert lse[0, 0].tolist() == pytest.approx([0.0, 1.3862944], abs=1e-6)


def test_attend_with_lse_in_float32_slices_equals_the_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # the route off a CPU: float32 matmuls, the queries in slices within MAX_SCORES (here 2 x 8 x
    # 3 x 9 = 432 elements: slices of 3 queries, the causal mask offset by each slice's start)
    q, k, v = (t.float() for t in _qkv(2, 9, 9, seed=12))
    for causal in (False, True):
        want, want_lse = attention.attend_with_lse(q, k, v, causal, 0.25, fused=True)
        monkeypatch.setattr(attention, "MAX_SCORES", 432)
        got, lse = attention.attend_with_lse(q, k, v, causal, 0.25, fused=False)
        monkeypatch.undo()
        assert float((got - want).abs().max()) < 1e-5 and float((lse - want_lse).abs().max()) < 1e-5


def test_merge_attention_by_hand() -> None:
    # part a: one key, output 2, normaliser e^0 = 1; part b: output 6, normaliser 3 (lse ln 3);
    # over both: (1 * 2 + 3 * 6) / (1 + 3) = 5
    out = torch.tensor([[2.0]])
    attention.merge_attention_(out, torch.tensor([0.0]), torch.tensor([[6.0]]), torch.tensor([1.0986123]))
    assert out.item() == pytest.approx(5.0, abs=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_prefix_attention_equals_attention_over_prompt_and_response(
    monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    # 3 rows, rows 0 and 1 continue prompt 0 (5 positions), row 2 prompt 1 (3 positions); responses
    # of 4 positions. Reference: each row's queries over [its prompt's keys, its response's keys]
    # with the response part causal, in float64.
    if not fused:
        real = attention.attend_with_lse
        monkeypatch.setattr(attention, "attend_with_lse", lambda *a: real(*a, fused=False))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 8, 4, 16, generator=g)  # [b, H, R, D]
    k, v = torch.randn(3, 2, 4, 16, generator=g), torch.randn(3, 2, 4, 16, generator=g)  # [b, KV, R, D]
    pk = [torch.randn(2, 5, 16, generator=g), torch.randn(2, 3, 16, generator=g)]  # [KV, P, D]
    pv = [torch.randn(2, 5, 16, generator=g), torch.randn(2, 3, 16, generator=g)]
    heads = Heads()
    heads.layer_idx = 0
    prefix = attention.PromptPrefix([pk], [pv], [(0, 0, 2), (1, 2, 3)])
    got, _ = attention.prefix_attention(heads, q, k, v, None, scaling=0.25, prompt_prefix=prefix)
    assert got.shape == (3, 4, 8, 16)
    for row, j in enumerate([0, 0, 1]):
        keys = torch.cat([pk[j], k[row]], 1)[None]  # [1, KV, P + R, D]
        values = torch.cat([pv[j], v[row]], 1)[None]
        p = pk[j].shape[1]
        keep = torch.ones(4, p + 4, dtype=torch.bool)
        keep[:, p:] = torch.ones(4, 4, dtype=torch.bool).tril()  # causal over the response
        want = _reference(q[row : row + 1], keys, values, keep[None, None], 0.25)
        assert float((got[row : row + 1].double() - want).abs().max()) < 1e-5
    with pytest.raises(RuntimeError, match="no backward"):
        attention.prefix_attention(heads, q.requires_grad_(), k, v, None, prompt_prefix=prefix)
    with pytest.raises(ValueError, match="no attention mask"):
        attention.prefix_attention(
            heads, q, k, v, torch.ones(3, 1, 4, 4, dtype=torch.bool), prompt_prefix=prefix
        )
