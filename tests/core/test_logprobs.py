"""core.logprobs: the one log-prob definition, and its chunked form equal to the plain one."""

from __future__ import annotations

import math

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
