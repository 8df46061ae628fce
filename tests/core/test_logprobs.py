"""core.logprobs: the one log-prob definition, and its chunked form equal to the plain one."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_batch.core.logprobs import chunked_logprobs, logprobs_from_logits


def test_logprobs_by_hand() -> None:
    # logits [0, ln 3]: softmax = [1/4, 3/4]
    #   log p(1) = ln 3/4 = -0.28768, log p(0) = ln 1/4 = -1.38629
    # temperature 2: logits / 2 = [0, ln sqrt(3)], softmax = [1, sqrt 3] / (1 + sqrt 3)
    #   log p(0) = -ln(1 + sqrt 3) = -1.00505
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    got = logprobs_from_logits(logits, torch.tensor([1, 0]))
    assert torch.allclose(got, torch.tensor([-0.2876821, -1.3862944]), atol=1e-6)
    got_t = logprobs_from_logits(logits[:1], torch.tensor([0]), temperature=2.0)
    assert torch.allclose(got_t, torch.tensor([-1.0050525]), atol=1e-6)
    # entropy of [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.34657 + 0.21576 = 0.56233
    _, ent = chunked_logprobs(logits[:1], lambda h: h, torch.tensor([0]), with_entropy=True)
    assert ent is not None and torch.allclose(ent, torch.tensor([0.5623351]), atol=1e-6)


def test_chunked_by_hand_with_an_identity_head() -> None:
    # hidden = logits (head = identity); 3 rows in chunks of 2 then 1 give the rows' own values:
    #   row 0 [0, ln 3] -> target 1: ln 3/4; row 1 [ln 3, 0] -> target 1: ln 1/4; row 2 [0, 0] -> ln 1/2
    hidden = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0], [0.0, 0.0]])
    lp, ent = chunked_logprobs(hidden, lambda h: h, torch.tensor([1, 1, 0]), chunk_size=2, with_entropy=True)
    assert torch.allclose(lp, torch.tensor([math.log(0.75), math.log(0.25), math.log(0.5)]), atol=1e-6)
    assert ent is not None and torch.allclose(ent[2], torch.tensor(math.log(2.0)), atol=1e-6)  # uniform: ln 2
    lp0, ent0 = chunked_logprobs(hidden[:0], lambda h: h, torch.tensor([], dtype=torch.long))
    assert lp0.shape == (0,) and ent0 is None


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    hidden=st.integers(1, 6),
    vocab=st.integers(2, 9),
    chunk=st.integers(1, 14),
    temperature=st.floats(0.3, 3.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_prop_chunked_equals_plain_log_softmax_values_and_gradients(
    n: int, hidden: int, vocab: int, chunk: int, temperature: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) * 3).requires_grad_()  # [N, H]
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))  # [V, H]
    targets = torch.randint(0, vocab, (n,), generator=g)  # [N]
    lp, ent = chunked_logprobs(h, head, targets, temperature, chunk_size=chunk, with_entropy=True)  # [N]
    logp_all = torch.log_softmax(head(h) / temperature, dim=-1)  # [N, V]
    plain = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    assert torch.allclose(lp, plain, atol=1e-5)
    assert ent is not None and torch.allclose(ent, -(logp_all.exp() * logp_all).sum(-1), atol=1e-5)
    # the written-out backward against autograd's through log_softmax, for a loss mixing both
    # outputs with random weights (as the GRPO loss and the entropy bonus do)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)  # [N], [N]
    (grad_chunked,) = torch.autograd.grad((a * lp).sum() + (b * ent).sum(), h)
    plain_ent = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    (grad_plain,) = torch.autograd.grad((a * plain).sum() + (b * plain_ent).sum(), h)
    assert torch.allclose(grad_chunked, grad_plain, atol=1e-4, rtol=1e-4)


def test_backward_by_hand() -> None:
    # logits x = [0, ln 3] (identity head), target 1: p = [1/4, 3/4], logp = [ln 1/4, ln 3/4]
    #   d logp_1 / dx = [0 - 1/4, 1 - 3/4] = [-0.25, 0.25]
    #   H = 0.56233; dH/dx_j = -p_j (logp_j + H): j=0: -0.25 (-1.38629 + 0.56233) = 0.20599
    #                                              j=1: -0.75 (-0.28768 + 0.56233) = -0.20599
    x = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    lp, _ = chunked_logprobs(x, lambda h: h, torch.tensor([1]))
    (g_lp,) = torch.autograd.grad(lp.sum(), x)
    assert torch.allclose(g_lp, torch.tensor([[-0.25, 0.25]]), atol=1e-6)
    _, ent = chunked_logprobs(x, lambda h: h, torch.tensor([1]), with_entropy=True)
    assert ent is not None
    (g_ent,) = torch.autograd.grad(ent.sum(), x)
    assert torch.allclose(g_ent, torch.tensor([[0.2059868, -0.2059868]]), atol=1e-6)
    # temperature 2 divides the gradient by 2 at the same p: x / 2 = [0, ln sqrt 3] gives
    # p = [1, sqrt 3] / (1 + sqrt 3) = [0.36603, 0.63397]; d logp_1 / dx = [-0.36603, 0.36603] / 2
    lp_t, _ = chunked_logprobs(x, lambda h: h, torch.tensor([1]), temperature=2.0)
    (g_t,) = torch.autograd.grad(lp_t.sum(), x)
    assert torch.allclose(g_t, torch.tensor([[-0.1830127, 0.1830127]]), atol=1e-6)


def test_backward_keeps_the_dtype_of_bf16_logits() -> None:
    # a bf16 LM head (autocast) gets a bf16 gradient; values as the float32 computation within bf16 rounding
    x32 = torch.randn(4, 7, generator=torch.Generator().manual_seed(0)) * 2
    x16 = x32.to(torch.bfloat16).requires_grad_()
    lp, _ = chunked_logprobs(x16, lambda h: h, torch.tensor([0, 3, 6, 1]))
    (g16,) = torch.autograd.grad(lp.sum(), x16)
    x_ref = x16.detach().float().requires_grad_()
    ref = torch.log_softmax(x_ref, -1).gather(-1, torch.tensor([[0], [3], [6], [1]])).sum()
    (g_ref,) = torch.autograd.grad(ref, x_ref)
    assert g16.dtype == torch.bfloat16 and torch.allclose(g16.float(), g_ref, atol=1e-2)


def _plain(h, w, b, targets, temperature):  # noqa: ANN001, ANN202
    """Reference: the whole [N, V] log_softmax through autograd, float32."""
    logp = torch.log_softmax(torch.nn.functional.linear(h, w, b) / temperature, dim=-1)  # [N, V]
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)  # [N], [N]


def test_linear_head_gradients_by_hand() -> None:
    # H = 1, V = 2, weight [[0], [ln 3]], bias [0, 0], hidden [[1]]: logits [0, ln 3], p = [1/4, 3/4]
    #   target 1: lp = ln 3/4 = -0.28768; d lp / d logits = [-1/4, 1/4]
    #   d lp / d hidden = sum_j (d lp / d logit_j) w_j = 1/4 ln 3 = 0.27465
    #   d lp / d weight = (d lp / d logits) outer hidden = [[-0.25], [0.25]]; d lp / d bias = [-0.25, 0.25]
    head = torch.nn.Linear(1, 2)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [math.log(3.0)]]))
        head.bias.zero_()
    h = torch.ones(1, 1, requires_grad=True)
    lp, _ = chunked_logprobs(h, head, torch.tensor([1]))
    assert torch.allclose(lp, torch.tensor([math.log(0.75)]), atol=1e-6)
    g_h, g_w, g_b = torch.autograd.grad(lp.sum(), [h, head.weight, head.bias])
    assert torch.allclose(g_h, torch.tensor([[0.2746531]]), atol=1e-6)
    assert torch.allclose(g_w, torch.tensor([[-0.25], [0.25]]), atol=1e-6)
    assert torch.allclose(g_b, torch.tensor([-0.25, 0.25]), atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    vocab=st.integers(2, 9),
    chunk=st.integers(1, 5),
    block_rows=st.integers(1, 6),
    pass_rows=st.integers(1, 6),
    temperature=st.floats(0.3, 3.0),
    bias=st.booleans(),
    use=st.sampled_from(["both", "lp", "entropy"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_prop_linear_head_equals_plain_values_and_all_gradients(
    n: int,
    vocab: int,
    chunk: int,
    block_rows: int,
    pass_rows: int,
    temperature: float,
    bias: bool,
    use: str,
    seed: int,
) -> None:
    # several chunks per block and several blocks (block_bytes = block_rows rows of float32 logits),
    # forward's and backward's float32 passes over slices of pass_rows rows of a chunk, a loss using
    # the log-probs, the entropies or both (an unused output gets no gradient)
    from rlhf_batch.core import logprobs
    from rlhf_batch.core.logprobs import linear_logprobs

    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, 4, generator=g) * 2).requires_grad_()  # [N, H]
    w = torch.randn(vocab, 4, generator=g).requires_grad_()  # [V, H]
    b = torch.randn(vocab, generator=g).requires_grad_() if bias else None  # [V]
    targets = torch.randint(0, vocab, (n,), generator=g)  # [N]
    a, c = torch.randn(n, generator=g), torch.randn(n, generator=g)  # [N]

    def loss(x_lp, x_ent):  # noqa: ANN001, ANN202
        return {
            "both": (a * x_lp).sum() + (c * x_ent).sum(),
            "lp": (a * x_lp).sum(),
            "entropy": (c * x_ent).sum(),
        }[use]

    params = [h, w] + ([b] if b is not None else [])
    kept = logprobs.PASS_ROWS, logprobs.PASS_ELEMENTS
    logprobs.PASS_ROWS, logprobs.PASS_ELEMENTS = pass_rows, 0  # pass_rows rows whatever the vocabulary
    try:  # forward and backward both under it
        lp, ent = linear_logprobs(
            h, w, b, targets, temperature, chunk, True, block_bytes=block_rows * vocab * 4
        )
        got = torch.autograd.grad(loss(lp, ent), params)
    finally:
        logprobs.PASS_ROWS, logprobs.PASS_ELEMENTS = kept
    ref_lp, ref_ent = _plain(h, w, b, targets, temperature)
    assert (
        torch.allclose(lp, ref_lp, atol=1e-5) and ent is not None and torch.allclose(ent, ref_ent, atol=1e-5)
    )
    want = torch.autograd.grad(loss(ref_lp, ref_ent), params)
    for x, y in zip(got, want, strict=True):
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)


def test_linear_head_in_bf16_as_autocast_runs_the_head() -> None:
    # under bf16 autocast the fused head computes in bf16 like autocast's own linear (the checkpointed
    # per-chunk path below): values and gradients agree within bf16 rounding, gradients come in the
    # inputs' dtype (float32 master weights); a bf16 weight without autocast, over several blocks,
    # gets a bf16 gradient summed in float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g).requires_grad_()  # [N, H]
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_logprobs(h, head, targets, 0.7, chunk_size=8, with_entropy=True)
        ref_lp, ref_ent = chunked_logprobs(
            h, lambda x: head(x), targets, 0.7, chunk_size=8, with_entropy=True
        )
    assert ent is not None and ref_ent is not None
    assert torch.allclose(lp, ref_lp, atol=1e-2) and torch.allclose(ent, ref_ent, atol=1e-2)
    got = torch.autograd.grad((lp + 0.1 * ent).sum(), [h, head.weight])
    want = torch.autograd.grad((ref_lp + 0.1 * ref_ent).sum(), [h, head.weight])
    for x, y in zip(got, want, strict=True):
        assert x.dtype == torch.float32
        assert torch.allclose(x, y, atol=2e-2, rtol=2e-2)

    from rlhf_batch.core.logprobs import linear_logprobs

    w16 = head.weight.detach().to(torch.bfloat16).requires_grad_()
    h16 = h.detach().to(torch.bfloat16).requires_grad_()
    lp16, _ = linear_logprobs(h16, w16, None, targets, block_bytes=10 * 50 * 2)  # 4 blocks of 10 rows
    (gw16,) = torch.autograd.grad(lp16.sum(), [w16])
    w32 = w16.detach().float().requires_grad_()
    ref, _ = _plain(h16.detach().float(), w32, None, targets, 1.0)
    (gw32,) = torch.autograd.grad(ref.sum(), [w32])
    assert gw16.dtype == torch.bfloat16 and torch.allclose(gw16.float(), gw32, atol=3e-2, rtol=3e-2)


def test_float32_passes_hold_16_rows_or_2_pow_19_logits() -> None:
    from rlhf_batch.core.logprobs import pass_rows

    # 2^19 = 524288 logits: 524288 // 32000 = 16 rows; a 128k vocabulary keeps 16 (4 would fit);
    # the demo's 105 tokens: 524288 // 105 = 4993 rows, its whole chunks in one pass
    assert (pass_rows(32000), pass_rows(128000), pass_rows(105)) == (16, 16, 4993)


def test_bf16_head_passes_over_slices_of_a_chunk_give_the_numbers_of_whole_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rlhf_batch.core import logprobs
    from rlhf_batch.core.logprobs import linear_logprobs

    g = torch.Generator().manual_seed(3)
    h = torch.randn(50, 16, generator=g).bfloat16()  # [N, H]
    w = torch.randn(300, 16, generator=g).bfloat16()  # [V, H]
    targets = torch.randint(0, 300, (50,), generator=g)
    assert logprobs.pass_rows(300) > 40  # a small vocabulary: whole chunks; here passes of 16 rows
    monkeypatch.setattr(logprobs, "PASS_ELEMENTS", 0)
    with torch.inference_mode():
        sliced = linear_logprobs(h, w, None, targets, 0.7, 40, True)  # chunks 40 + 10, passes of 16 rows
        monkeypatch.setattr(logprobs, "PASS_ROWS", 40)
        whole = linear_logprobs(h, w, None, targets, 0.7, 40, True)
    assert logprobs.PASS_ROWS == 40 and torch.equal(sliced[0], whole[0]) and torch.equal(sliced[1], whole[1])
    ref_lp, _ = _plain(h.float(), w.float(), None, targets, 0.7)
    # bf16 logits carry a relative rounding error of 2^-9 each: a log-prob (its logit minus the
    # log-normaliser) errs by at most ~2 x 2^-9 of the largest |logit / T|
    bound = 2 * 2**-9 * float((h.float() @ w.float().t()).abs().max()) / 0.7
    assert float((sliced[0] - ref_lp).abs().max()) < bound


def test_linear_head_without_gradients_keeps_no_graph() -> None:
    head = torch.nn.Linear(3, 5)
    h = torch.randn(4, 3)
    with torch.inference_mode():
        lp, _ = chunked_logprobs(h, head, torch.tensor([0, 1, 2, 3]))
    assert not lp.requires_grad
    assert torch.allclose(
        lp, _plain(h, head.weight, head.bias, torch.tensor([0, 1, 2, 3]), 1.0)[0], atol=1e-6
    )
