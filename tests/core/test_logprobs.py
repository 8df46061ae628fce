"""core.logprobs: the one log-prob definition, and its chunked form equal to the plain one."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_batch.core.logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits


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
    assert torch.allclose(entropy_from_logits(logits[:1]), torch.tensor([0.5623351]), atol=1e-6)


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
    (grad_chunked,) = torch.autograd.grad(lp.sum(), h)
    (grad_plain,) = torch.autograd.grad(plain.sum(), h)
    assert torch.allclose(grad_chunked, grad_plain, atol=1e-5)
