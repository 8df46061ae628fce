import math

import torch

from rlhf_batch.core.sampling import filter_logits, sample_from_uniform

NEG = float("-inf")


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert filter_logits(logits, top_k=2).tolist() == [[NEG, 3.0, 2.0, NEG]]


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.2 (logits are their logs). Sorted: 0.5, 0.3, 0.2 with mass before
    # each token 0, 0.5, 0.8. top_p = 0.6 keeps tokens whose preceding mass < 0.6: the first two.
    logits = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    out = filter_logits(logits, top_p=0.6)
    assert torch.isinf(out[0, 2]) and torch.isfinite(out[0, :2]).all()
    # top_p = 0.4: the most likely token alone already reaches it
    out = filter_logits(logits, top_p=0.4)
    assert torch.isfinite(out).tolist() == [[False, True, False]]


def test_inverse_cdf_draws() -> None:
    # probabilities 0.25, 0.25, 0.5 -> cdf 0.25, 0.5, 1.0; u picks the first token with cdf > u
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5]] * 4))
    u = torch.tensor([0.0, 0.2499, 0.3, 0.9999])
    assert sample_from_uniform(logits, u).tolist() == [0, 0, 1, 2]


def test_filtered_tokens_are_never_drawn() -> None:
    logits = torch.tensor([[NEG, 0.0, NEG, 0.0]] * 3)
    # cdf 0, 0.5, 0.5, 1.0: u = 0 must not pick token 0, u = 0.5 must not pick token 2
    assert sample_from_uniform(logits, torch.tensor([0.0, 0.5, 0.75])).tolist() == [1, 3, 3]


def test_draw_frequencies_follow_the_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(20000, 3)
    counts = torch.bincount(sample_from_uniform(logits, torch.rand(20000, generator=g)), minlength=3) / 20000
    # binomial std at p=0.6, n=20000: sqrt(0.24/20000) = 0.0035; 5 sigma = 0.017
    for got, want in zip(counts.tolist(), [0.1, 0.6, 0.3], strict=True):
        assert math.isclose(got, want, abs_tol=0.017)
