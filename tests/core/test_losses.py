"""Tests for rlhf_batch.core.losses: hand-worked tiny examples plus hypothesis properties.

Expected values are worked out by hand in the comments (never by calling the code under test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_batch.core.losses import AGGREGATIONS, GRPOLossOutput, grpo_loss, k3, masked_mean, masked_sum

T_ = torch.tensor
FIELDS = (
    "loss",
    "loss_objective",
    "loss_kl_to_ref",
    "loss_kl_to_inference",
    "loss_entropy",
    "clip_fraction",
    "kl_approx",
    "kl_to_ref",
    "entropy",
    "ratio_mean",
)


def close(x: torch.Tensor, expected: float, tol: float = 1e-5) -> None:
    assert x.shape == torch.Size([])
    assert x.item() == pytest.approx(expected, abs=tol), (x.item(), expected)


def full_mask(b: int, t: int) -> torch.Tensor:
    return torch.ones(b, t, dtype=torch.bool)


# ---------------------------------------------------------------------------- helpers


def test_masked_helpers_ignore_padding_even_nan() -> None:
    x = T_([[1.0, 3.0, float("nan")], [5.0, float("inf"), 0.0]])
    m = T_([[True, True, False], [True, False, False]])
    close(masked_sum(x, m), 9.0)  # 1 + 3 + 5
    close(masked_mean(x, m), 3.0)  # 9 / 3
    close(masked_mean(x, torch.zeros_like(m)), 0.0)  # empty mask -> 0, not nan


def test_k3_values() -> None:
    # d = ref - logp. d=0.5: e^0.5 - 0.5 - 1 = 1.648721 - 1.5 = 0.148721
    # d=-0.5: e^-0.5 + 0.5 - 1 = 0.606531 - 0.5 = 0.106531 ; padding -> 0
    out = k3(T_([[0.0, 0.0, 0.0]]), T_([[0.5, -0.5, 7.0]]), T_([[True, True, False]]))
    assert torch.allclose(out, T_([[0.148721, 0.106531, 0.0]]), atol=1e-6)


# ---------------------------------------------------------------------------- output type


def test_output_is_scalar_tensorclass_with_detached_metrics() -> None:
    logp = T_([[0.1, -0.2]], requires_grad=True)
    out = grpo_loss(logp, T_([[0.0, 0.0]]), T_([1.0]), full_mask(1, 2), ref_logprobs=T_([[0.0, 0.0]]))
    assert isinstance(out, GRPOLossOutput)
    assert out.batch_size == torch.Size([])
    for f in FIELDS:
        assert getattr(out, f).shape == torch.Size([]), f
    assert out.loss.requires_grad and out.loss_objective.requires_grad
    for f in ("clip_fraction", "kl_approx", "kl_to_ref", "entropy", "ratio_mean"):
        assert not getattr(out, f).requires_grad, f


# ---------------------------------------------------------------------------- clipping


def test_clip_binds_for_positive_advantage() -> None:
    # A = +1, eps = 0.2, old = 0.
    # tok0: r = e^0.5 = 1.648721 > 1.2 -> min(1.6487, 1.2) = 1.2 -> loss -1.2  (clip binds)
    # tok1: r = e^0 = 1 -> loss -1
    # token_mean = (-1.2 - 1) / 2 = -1.1 ; clip_fraction = 1/2
    # ratio_mean = (1.648721 + 1) / 2 = 1.324361
    logp = T_([[0.5, 0.0]], requires_grad=True)
    out = grpo_loss(logp, T_([[0.0, 0.0]]), T_([1.0]), full_mask(1, 2))
    close(out.loss, -1.1)
    close(out.loss_objective, -1.1)
    close(out.clip_fraction, 0.5)
    close(out.ratio_mean, 1.324361)
    out.loss.backward()
    # d/dlogp: clipped token -> 0 ; tok1: -A * r / N = -1 * 1 / 2 = -0.5
    assert torch.allclose(logp.grad, T_([[0.0, -0.5]]))


def test_clip_binds_for_negative_advantage_only_below_one_minus_eps() -> None:
    # A = -1, eps = 0.2, old = 0.
    # tok0: r = e^-0.5 = 0.606531; r*A = -0.606531, clip(r)*A = 0.8*-1 = -0.8
    #       min = -0.8 (clipped selected, differs) -> loss 0.8, binds
    # tok1: r = e^0.5 = 1.648721; r*A = -1.648721, clip*A = -1.2; min = -1.648721
    #       (unclipped selected) -> loss 1.648721, does NOT bind
    # tok2: r = 1 -> loss 1
    # token_mean = (0.8 + 1.648721 + 1) / 3 = 3.448721 / 3 = 1.149574 ; clip_fraction = 1/3
    logp = T_([[-0.5, 0.5, 0.0]], requires_grad=True)
    out = grpo_loss(logp, torch.zeros(1, 3), T_([-1.0]), full_mask(1, 3))
    close(out.loss, 1.149574)
    close(out.clip_fraction, 1 / 3)
    out.loss.backward()
    # grads: tok0 clipped -> 0 ; tok1: -A*r/3 = 1.648721/3 = 0.549574 ; tok2: 1/3
    assert torch.allclose(logp.grad, T_([[0.0, 0.549574, 1 / 3]]), atol=1e-6)


@pytest.mark.parametrize(
    ("logp", "adv", "binds"),
    [
        (0.5, 1.0, 1.0),  # r = 1.6487 > 1.2, A > 0: min picks 1.2 * A -> binds
        (-0.5, 1.0, 0.0),  # r = 0.6065 < 0.8, A > 0: min picks r * A (smaller) -> no bind
        (0.5, -1.0, 0.0),  # r = 1.6487, A < 0: r*A = -1.6487 < -1.2 -> unclipped picked
        (-0.5, -1.0, 1.0),  # r = 0.6065, A < 0: 0.8*A = -0.8 < -0.6065 -> clipped picked, binds
        (0.5, 0.0, 0.0),  # A = 0: both terms 0, never binds
        (0.1, 1.0, 0.0),  # r = 1.1052 inside [0.8, 1.2] -> no clip
    ],
)
def test_clip_fraction_single_token_table(logp: float, adv: float, binds: float) -> None:
    out = grpo_loss(T_([[logp]]), T_([[0.0]]), T_([adv]), full_mask(1, 1))
    close(out.clip_fraction, binds)


def test_positive_advantage_below_lower_bound_is_not_clipped() -> None:
    # A = +1, r = e^-0.5 = 0.606531 < 0.8: min(0.606531, 0.8) = 0.606531 -> unclipped, no bind
    out = grpo_loss(T_([[-0.5]]), T_([[0.0]]), T_([1.0]), full_mask(1, 1))
    close(out.loss, -0.606531)
    close(out.clip_fraction, 0.0)


def test_eps_high_separate_from_eps_low() -> None:
    # eps_low = 0.2, eps_high = 0.28, old = 0, r = [e^0.25, e^-0.25] = [1.284025, 0.778801]
    # A = +1: tok0 min(1.284025, 1.28) = 1.28 (binds on eps_high) ; tok1 min(0.778801, 0.8) = 0.778801
    #   loss = -(1.28 + 0.778801) / 2 = -1.0294005 ; clip_fraction = 1/2
    logp = T_([[0.25, -0.25]])
    old = torch.zeros(1, 2)
    out = grpo_loss(logp, old, T_([1.0]), full_mask(1, 2), eps_low=0.2, eps_high=0.28)
    close(out.loss, -1.0294005)
    close(out.clip_fraction, 0.5)
    # symmetric eps = 0.2 for contrast: -(1.2 + 0.778801) / 2 = -0.9894005
    close(grpo_loss(logp, old, T_([1.0]), full_mask(1, 2)).loss, -0.9894005)
    # A = -1: tok0 min(-1.284025, -1.28) = -1.284025 -> 1.284025 (no bind)
    #         tok1 min(-0.778801, -0.8) = -0.8 -> 0.8 (binds on eps_low)
    #   loss = (1.284025 + 0.8) / 2 = 1.0420125 ; clip_fraction = 1/2
    out = grpo_loss(logp, old, T_([-1.0]), full_mask(1, 2), eps_low=0.2, eps_high=0.28)
    close(out.loss, 1.0420125)
    close(out.clip_fraction, 0.5)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    # Same tokens as the A<0 case, dual_clip c = 1.5: cap = -c*A = 1.5
    # tok0: min(0.8, 1.5) = 0.8 ; tok1: min(1.648721, 1.5) = 1.5 ; tok2: min(1, 1.5) = 1
    # token_mean = (0.8 + 1.5 + 1) / 3 = 1.1
    logp = T_([[-0.5, 0.5, 0.0]], requires_grad=True)
    out = grpo_loss(logp, torch.zeros(1, 3), T_([-1.0]), full_mask(1, 3), dual_clip=1.5)
    close(out.loss, 1.1)
    close(out.clip_fraction, 1 / 3)  # dual clip is not counted in clip_fraction
    out.loss.backward()
    # tok1 is now capped by a constant -> grad 0 ; tok2: 1/3
    assert torch.allclose(logp.grad, T_([[0.0, 0.0, 1 / 3]]), atol=1e-6)


def test_dual_clip_does_not_touch_positive_advantage() -> None:
    # A = +1, r = e^0.5: loss -1.2 as without dual clip (cap applies only to A < 0)
    out = grpo_loss(T_([[0.5]]), T_([[0.0]]), T_([1.0]), full_mask(1, 1), dual_clip=1.5)
    close(out.loss, -1.2)


def test_on_policy_ratio_is_one() -> None:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g) * 3
    out = grpo_loss(logp, logp.clone(), torch.randn(3, generator=g), full_mask(3, 4))
    close(out.ratio_mean, 1.0)
    close(out.clip_fraction, 0.0)
    close(out.kl_approx, 0.0)


# ---------------------------------------------------------------------------- aggregation


def agg_case() -> tuple[torch.Tensor, ...]:
    # ratio 1 everywhere, so loss_tok = -A. Row0 has 1 real token (A=2), row1 3 tokens (A=-1).
    # Row0 padding holds garbage (100, nan) which must be ignored.
    logp = T_([[0.0, 100.0, float("nan")], [-1.0, -2.0, -3.0]])
    old = T_([[0.0, -5.0, 0.0], [-1.0, -2.0, -3.0]])
    mask = T_([[True, False, False], [True, True, True]])
    return logp, old, T_([2.0, -1.0]), mask


@pytest.mark.parametrize(
    ("aggregation", "norm_const", "expected"),
    [
        ("token_mean", None, 0.25),  # (-2 + 1 + 1 + 1) / 4 real tokens = 0.25
        ("seq_mean_token_mean", None, -0.5),  # row means -2 and 1 -> (-2 + 1) / 2 = -0.5
        ("seq_mean_token_sum_norm", 4.0, 0.125),  # (-2/4 + 3/4) / 2 = 0.25 / 2 = 0.125
    ],
)
def test_aggregations(aggregation: str, norm_const: float | None, expected: float) -> None:
    logp, old, adv, mask = agg_case()
    out = grpo_loss(logp, old, adv, mask, aggregation=aggregation, norm_const=norm_const)
    close(out.loss, expected)


@pytest.mark.parametrize(
    ("aggregation", "norm_const", "denominator", "expected"),
    [
        ("token_mean", None, 8, 0.125),  # sum = 1, / 8 tokens in the whole step
        ("seq_mean_token_mean", None, 4, -0.25),  # sum of row means = -1, / 4 sequences
        ("seq_mean_token_sum_norm", 4.0, 5, 0.05),  # (-0.5 + 0.75) = 0.25, / 5 sequences
    ],
)
def test_denominator_replaces_local_count(
    aggregation: str, norm_const: float | None, denominator: int, expected: float
) -> None:
    logp, old, adv, mask = agg_case()
    out = grpo_loss(
        logp, old, adv, mask, aggregation=aggregation, norm_const=norm_const, denominator=denominator
    )
    close(out.loss, expected)


def test_all_padding_row_is_not_counted_as_a_sequence() -> None:
    # Appending an empty row: seq_mean_token_mean stays (-2 + 1) / 2 = -0.5 (not / 3)
    logp, old, adv, mask = agg_case()
    logp, old = torch.cat([logp, torch.zeros(1, 3)]), torch.cat([old, torch.zeros(1, 3)])
    adv, mask = torch.cat([adv, T_([9.0])]), torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    close(grpo_loss(logp, old, adv, mask, aggregation="seq_mean_token_mean").loss, -0.5)


def test_empty_mask_gives_zeros_not_nan() -> None:
    logp = T_([[0.3, 0.1]], requires_grad=True)
    mask = torch.zeros(1, 2, dtype=torch.bool)
    out = grpo_loss(logp, torch.zeros(1, 2), T_([1.0]), mask, ref_logprobs=torch.zeros(1, 2), kl_coef=0.1)
    for f in FIELDS:
        close(getattr(out, f), 0.0)
    out.loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))


# ---------------------------------------------------------------------------- KL and entropy


def test_kl_to_ref_term_and_coefficient() -> None:
    # logp = old = 0 and A = 0, so the objective is 0.
    # k3 with d = ref - logp: d=0.5 -> 0.148721 ; d=-0.5 -> 0.106531 ; mean = 0.127626
    # kl_coef = 0.1 -> loss_kl_to_ref = 0.0127626 = loss
    logp = T_([[0.0, 0.0]], requires_grad=True)
    ref = T_([[0.5, -0.5]])
    out = grpo_loss(logp, torch.zeros(1, 2), T_([0.0]), full_mask(1, 2), ref_logprobs=ref, kl_coef=0.1)
    close(out.loss_objective, 0.0)
    close(out.loss_kl_to_ref, 0.0127626)
    close(out.loss, 0.0127626)
    close(out.kl_to_ref, 0.127626)
    out.loss.backward()
    # d k3 / d logp = 1 - e^(ref - logp): [1 - 1.648721, 1 - 0.606531] = [-0.648721, 0.393469]
    # times kl_coef / N = 0.1 / 2 -> [-0.0324361, 0.0196735]
    assert torch.allclose(logp.grad, T_([[-0.0324361, 0.0196735]]), atol=1e-6)
    # coefficient 0: no loss term, metric still reported
    out0 = grpo_loss(logp, torch.zeros(1, 2), T_([0.0]), full_mask(1, 2), ref_logprobs=ref)
    close(out0.loss_kl_to_ref, 0.0)
    close(out0.kl_to_ref, 0.127626)
    # no ref: metric 0
    close(grpo_loss(logp, torch.zeros(1, 2), T_([0.0]), full_mask(1, 2)).kl_to_ref, 0.0)


def test_kl_to_inference_and_kl_approx_estimators() -> None:
    # old = 0, logp = [0.5, 0], A = 0.
    # loss term uses k3 with old in place of ref: d = old - logp = [-0.5, 0]
    #   -> [e^-0.5 + 0.5 - 1, 0] = [0.106531, 0] ; mean 0.0532655 ; coef 0.5 -> 0.0266328
    # kl_approx = mean(r - 1 - log r), r = [e^0.5, 1] -> [1.648721 - 1 - 0.5, 0] = [0.148721, 0]
    #   -> 0.0743605
    out = grpo_loss(T_([[0.5, 0.0]]), torch.zeros(1, 2), T_([0.0]), full_mask(1, 2), kl_to_inference_coef=0.5)
    close(out.loss_kl_to_inference, 0.0266328)
    close(out.loss, 0.0266328)
    close(out.kl_approx, 0.0743605)


def test_entropy_bonus() -> None:
    # entropy on real tokens [1, 2] (padding 99 ignored): mean 1.5 ; coef 0.01 -> -0.015
    ent = T_([[1.0, 2.0, 99.0]])
    mask = T_([[True, True, False]])
    out = grpo_loss(torch.zeros(1, 3), torch.zeros(1, 3), T_([0.0]), mask, entropy=ent, entropy_coef=0.01)
    close(out.loss_entropy, -0.015)
    close(out.loss, -0.015)
    close(out.entropy, 1.5)
    out0 = grpo_loss(torch.zeros(1, 3), torch.zeros(1, 3), T_([0.0]), mask)
    close(out0.entropy, 0.0)


def test_total_loss_is_sum_of_terms() -> None:
    # A = +1, logp = [0.5, 0] (objective -1.1 from the first clip test),
    # ref = 0: k3 d = [-0.5, 0] -> mean 0.0532655, kl_coef 0.2 -> 0.0106531
    # kl_to_inference same k3 with old = 0 -> coef 0.1 -> 0.00532655
    # entropy [1, 3] mean 2, coef 0.05 -> -0.1
    # total = -1.1 + 0.0106531 + 0.00532655 - 0.1 = -1.18402035
    out = grpo_loss(
        T_([[0.5, 0.0]]),
        torch.zeros(1, 2),
        T_([1.0]),
        full_mask(1, 2),
        ref_logprobs=torch.zeros(1, 2),
        kl_coef=0.2,
        kl_to_inference_coef=0.1,
        entropy=T_([[1.0, 3.0]]),
        entropy_coef=0.05,
    )
    close(out.loss, -1.18402035)


# ---------------------------------------------------------------------------- padding and splitting


def test_padding_with_garbage_changes_nothing() -> None:
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(2, 3, generator=g) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(2, 3, generator=g)
    ref = logp.detach() + 0.3 * torch.randn(2, 3, generator=g)
    adv = torch.randn(2, 3, generator=g)  # per-token advantages, also padded with garbage
    ent = torch.rand(2, 3, generator=g)
    mask = T_([[True, True, False], [True, True, True]])
    kw = dict(kl_coef=0.1, kl_to_inference_coef=0.05, entropy_coef=0.01, dual_clip=3.0)
    base = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, entropy=ent, **kw)
    base.loss.backward()
    garbage = T_([[float("nan"), float("inf")], [-float("inf"), 1e4]])

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, garbage], dim=1)  # [2, 5]

    logp_p = pad(logp.detach()).requires_grad_()
    mask_p = torch.cat([mask, torch.zeros(2, 2, dtype=torch.bool)], dim=1)
    padded = grpo_loss(logp_p, pad(old), pad(adv), mask_p, ref_logprobs=pad(ref), entropy=pad(ent), **kw)
    padded.loss.backward()
    for f in FIELDS:
        assert torch.allclose(getattr(padded, f), getattr(base, f), atol=1e-6), f
    assert torch.allclose(logp_p.grad[:, :3], logp.grad, atol=1e-7)
    assert torch.equal(logp_p.grad[:, 3:], torch.zeros(2, 2))
    assert torch.equal(logp_p.grad[0, 2], T_(0.0))  # in-row padding also gets no gradient


def test_micro_batches_with_denominator_match_big_batch_gradients() -> None:
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(4, 5, generator=g) * 2
    old = logp + 0.4 * torch.randn(4, 5, generator=g)
    ref = logp + 0.4 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, generator=g)
    lengths = T_([5, 2, 4, 1])
    mask = torch.arange(5)[None, :] < lengths[:, None]  # [4, 5] from lengths
    kw = dict(ref_logprobs=ref, kl_coef=0.1, kl_to_inference_coef=0.05)

    big_logp = logp.clone().requires_grad_()
    big = grpo_loss(big_logp, old, adv, mask, **kw)
    big.loss.backward()

    mb_logp = logp.clone().requires_grad_()
    n_tokens = int(mask.sum())  # 12 real tokens in the whole step
    total = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 4)):
        kw_mb = dict(ref_logprobs=ref[rows], kl_coef=0.1, kl_to_inference_coef=0.05)
        out = grpo_loss(mb_logp[rows], old[rows], adv[rows], mask[rows], denominator=n_tokens, **kw_mb)
        out.loss.backward()
        total = total + out.loss.detach()
    assert torch.allclose(total, big.loss.detach(), atol=1e-6)
    assert torch.allclose(mb_logp.grad, big_logp.grad, atol=1e-6)


def test_truncated_importance_sampling_weights_the_objective() -> None:
    # A = +1, eps = 0.2, logp = old = 0 (on-policy for the trainer: r = 1, loss_tok = -1 each).
    # behaviour log-probs from the engine: [0, ln 2, -ln 4] -> w = min(exp(old - beh), cap = 2):
    #   tok0: exp(0) = 1           -> 1
    #   tok1: exp(-ln 2) = 0.5     -> 0.5
    #   tok2: exp(ln 4) = 4 > 2    -> 2 (truncated)
    # token_mean objective = (-1 * 1 - 1 * 0.5 - 1 * 2) / 3 = -3.5 / 3 = -1.166667
    # gradient d/dlogp_t = -A * r * w / N = [-1/3, -0.5/3, -2/3]
    logp = T_([[0.0, 0.0, 0.0]], requires_grad=True)
    beh = T_([[0.0, math.log(2.0), -math.log(4.0)]])
    out = grpo_loss(
        logp, T_([[0.0, 0.0, 0.0]]), T_([1.0]), full_mask(1, 3), behavior_logprobs=beh, tis_cap=2.0
    )
    close(out.loss_objective, -3.5 / 3)
    close(out.ratio_mean, 1.0)  # the PPO ratio is still logp - old: the weight is not part of it
    out.loss.backward()
    assert torch.allclose(logp.grad, T_([[-1 / 3, -0.5 / 3, -2 / 3]]))


def test_truncated_importance_sampling_leaves_kl_terms_and_padding_alone() -> None:
    # A = -1, eps = 0.2; one real token (the second is padding with a garbage behaviour log-prob).
    # logp = old = ln 0.5; ref = ln 0.25; beh = ln 0.25 -> w = min(0.5 / 0.25, 3) = 2.
    # objective: r = 1 -> loss_tok = -min(1 * -1, 1 * -1) = 1, times w = 2 -> 2
    # k3 to ref: exp(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1 = 0.193147; kl_coef 0.1 -> 0.019315
    # loss = 2 + 0.019315 = 2.019315 (the weight multiplies the objective only, as TRL does)
    lp = math.log(0.5)
    logp = T_([[lp, 0.0]])
    mask = T_([[True, False]])
    beh = T_([[math.log(0.25), float("nan")]])
    out = grpo_loss(
        logp,
        T_([[lp, 0.0]]),
        T_([-1.0]),
        mask,
        ref_logprobs=T_([[math.log(0.25), 0.0]]),
        kl_coef=0.1,
        behavior_logprobs=beh,
        tis_cap=3.0,
    )
    close(out.loss_objective, 2.0)
    close(out.loss_kl_to_ref, 0.0193147)
    close(out.loss, 2.0193147)


def test_tis_cap_off_ignores_behaviour_logprobs() -> None:
    # tis_cap = 0: behaviour log-probs far from old change nothing (r = 1, A = 1 -> loss -1)
    out = grpo_loss(T_([[0.0]]), T_([[0.0]]), T_([1.0]), full_mask(1, 1), behavior_logprobs=T_([[-9.0]]))
    close(out.loss, -1.0)


# ---------------------------------------------------------------------------- errors


def test_bad_aggregation_is_named() -> None:
    with pytest.raises(ValueError, match="bogus"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), T_([1.0]), full_mask(1, 1), aggregation="bogus")


def test_missing_norm_const() -> None:
    with pytest.raises(ValueError, match="norm_const"):
        grpo_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            T_([1.0]),
            full_mask(1, 1),
            aggregation="seq_mean_token_sum_norm",
        )


@pytest.mark.parametrize("c", [1.0, 0.5, -2.0])
def test_dual_clip_must_exceed_one(c: float) -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), T_([1.0]), full_mask(1, 1), dual_clip=c)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kl_coef=0.1), "ref_logprobs"),
        (dict(entropy_coef=0.1), "entropy"),
        (dict(denominator=0), "denominator"),
        (dict(eps_low=-0.1), "eps"),
        (dict(tis_cap=2.0), "behavior_logprobs"),
        (dict(tis_cap=-1.0, behavior_logprobs=torch.zeros(1, 1)), "tis_cap"),
    ],
)
def test_other_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), T_([1.0]), full_mask(1, 1), **kwargs)


def test_non_bool_mask_rejected() -> None:
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), T_([1.0]), torch.ones(1, 2))


def test_bf16_inputs_computed_in_float32() -> None:
    out = grpo_loss(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2), T_([1.0]), full_mask(1, 2))
    assert out.loss.dtype == torch.float32
    close(out.loss, -1.0)  # ratio 1, A = 1 -> -1


# ---------------------------------------------------------------------------- properties


@dataclass
class Case:
    logp: torch.Tensor  # [B, T]
    old: torch.Tensor  # [B, T]
    ref: torch.Tensor  # [B, T]
    adv: torch.Tensor  # [B]
    ent: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] bool, from lengths
    kw: dict[str, Any]
    extra: int  # padding columns to append
    split: int  # micro-batch split row

    def run(self, rows: slice = slice(None), **extra: Any) -> tuple[GRPOLossOutput, torch.Tensor]:
        logp = self.logp[rows].clone().requires_grad_()
        out = grpo_loss(
            logp,
            self.old[rows],
            self.adv[rows],
            self.mask[rows],
            ref_logprobs=self.ref[rows],
            entropy=self.ent[rows],
            **self.kw,
            **extra,
        )
        out.loss.backward()
        assert logp.grad is not None
        return out, logp.grad


@st.composite
def cases(draw: st.DrawFn, min_b: int = 1) -> Case:
    b = draw(st.integers(min_b, 4))
    t = draw(st.integers(1, 5))
    lengths = torch.tensor(draw(st.lists(st.integers(0, t), min_size=b, max_size=b)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    aggregation = draw(st.sampled_from(AGGREGATIONS))
    logp = -torch.rand(b, t, generator=g) * 3
    return Case(
        logp=logp,
        old=logp + 0.5 * torch.randn(b, t, generator=g),
        ref=logp + 0.5 * torch.randn(b, t, generator=g),
        adv=torch.randn(b, generator=g),
        ent=torch.rand(b, t, generator=g),
        mask=torch.arange(t)[None, :] < lengths[:, None],
        kw=dict(
            aggregation=aggregation,
            norm_const=float(t) if aggregation == "seq_mean_token_sum_norm" else None,
            eps_high=draw(st.sampled_from([None, 0.28])),
            dual_clip=draw(st.sampled_from([None, 3.0])),
            kl_coef=0.1,
            kl_to_inference_coef=0.05,
            entropy_coef=0.01,
        ),
        extra=draw(st.integers(1, 3)),
        split=draw(st.integers(1, max(1, b - 1))),
    )


@settings(max_examples=50, deadline=None)
@given(cases())
def test_property_extra_padding_changes_nothing(c: Case) -> None:
    base, grad = c.run()
    b, t = c.mask.shape
    junk = torch.full((b, c.extra), float("nan"))  # garbage in every padded column

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, junk], 1)

    no_tok = torch.zeros(b, c.extra, dtype=torch.bool)
    padded = replace(
        c,
        logp=pad(c.logp),
        old=pad(c.old),
        ref=pad(c.ref),
        ent=pad(c.ent),
        mask=torch.cat([c.mask, no_tok], 1),
    )
    out, grad_p = padded.run()
    for f in FIELDS:
        assert torch.allclose(getattr(out, f), getattr(base, f), atol=1e-5), f
    assert torch.allclose(grad_p[:, :t], grad, atol=1e-6)
    assert not grad_p[:, t:].any()


@settings(max_examples=50, deadline=None)
@given(cases(min_b=2))
def test_property_micro_batches_sum_to_big_batch(c: Case) -> None:
    per_token = c.kw["aggregation"] == "token_mean"
    n = int(c.mask.sum()) if per_token else int(c.mask.any(-1).sum())  # global normaliser
    big, grad = c.run()
    a, ga = c.run(slice(0, c.split), denominator=max(n, 1))
    b, gb = c.run(slice(c.split, None), denominator=max(n, 1))
    assert torch.allclose(a.loss + b.loss, big.loss, atol=1e-5)
    assert torch.allclose(torch.cat([ga, gb]), grad, atol=1e-6)


def test_k3_is_bounded_at_the_clamps() -> None:
    # d = ref - logp, clamped to [-20, 20], then k3 = e^d - d - 1 clamped to [0, 10].
    # d = 2:     e^2 - 3 = 7.389056 - 3 = 4.389056               (no clamp binds)
    # d = 2.5:   e^2.5 - 3.5 = 12.182494 - 3.5 = 8.682494         (just under 10)
    # d = 3:     e^3 - 4 = 20.085537 - 4 = 16.085537 -> 10         (value clamp)
    # d = 25:    clamped to 20 -> e^20 - 21 ~ 4.85e8 -> 10         (both clamps)
    # d = -10.5: e^-10.5 + 10.5 - 1 = 0.0000275 + 9.5 = 9.5000275  (no clamp binds)
    # d = -12:   e^-12 + 11 = 11.0000061 -> 10                     (value clamp)
    d = T_([[2.0, 2.5, 3.0, 25.0, -10.5, -12.0]])
    logp = torch.zeros_like(d, requires_grad=True)
    out = k3(logp, d, full_mask(1, 6))
    expected = T_([[4.389056, 8.682494, 10.0, 10.0, 9.5000275, 10.0]])
    assert torch.allclose(out, expected, atol=1e-5)
    out.sum().backward()
    # d k3 / d logp = 1 - e^d where no clamp binds, 0 where one does:
    # d = 2: 1 - 7.389056 = -6.389056 ; d = 2.5: 1 - 12.182494 = -11.182494 ; d = -10.5: 1 - 0.0000275
    expected_grad = T_([[-6.389056, -11.182494, 0.0, 0.0, 0.9999725, 0.0]])
    assert torch.allclose(logp.grad, expected_grad, atol=1e-5)


def test_kl_to_ref_metric_is_bounded() -> None:
    # one token with logp = -30 under a reference that gives it 0: d = 30 -> clamped -> k3 = 10,
    # one token at d = 0 -> 0: kl_to_ref = 5 (unbounded it would be (e^30 - 31) / 2 ~ 5.3e12)
    logp = T_([[-30.0, 0.0]])
    out = grpo_loss(
        logp, logp.clone(), T_([0.0]), full_mask(1, 2), ref_logprobs=T_([[0.0, 0.0]]), kl_coef=1.0
    )
    close(out.kl_to_ref, 5.0)
    close(out.loss_kl_to_ref, 5.0)


def test_decoupled_objective_of_a_stale_run_by_hand() -> None:
    # max_staleness = 1: train passes recompute_old's log-probs as `old` (the proximal anchor, the
    # policy train K starts from) and generate's as `behavior_logprobs` (the policy of K - 2),
    # with the cap the config resolves for S > 0 (5). eps = 0.2, token_mean over 4 real tokens.
    # Probabilities per token (new, old = anchor, behaviour), A per row:
    #   row 0, A = +1:  t0 (0.55, 0.5, 0.25)  r = 1.1 (inside the clip)      w = 2
    #                   t1 (0.9,  0.6, 0.1 )  r = 1.5 -> clipped 1.2          w = 6 -> capped 5
    #   row 1, A = -2:  t2 (0.2,  0.4, 0.5 )  r = 0.5; -min(-1, -1.6) = 1.6   w = 0.8
    #                   t3 (0.3,  0.3, 0.3 )  r = 1;   -min(-2, -2) = 2       w = 1
    # loss_tok * w: -1.1 * 2 = -2.2, -1.2 * 5 = -6, 1.6 * 0.8 = 1.28, 2 * 1 = 2
    # objective = (-2.2 - 6 + 1.28 + 2) / 4 = -4.92 / 4 = -1.23
    # lock-step defaults (no weight) on the same batch: (-1.1 - 1.2 + 1.6 + 2) / 4 = 0.325
    from rlhf_batch.config import Config
    from rlhf_batch.stages.train.step import _loss_kwargs

    def lp(*p: float) -> torch.Tensor:
        return T_([[math.log(p[0]), math.log(p[1])], [math.log(p[2]), math.log(p[3])]])

    new, old, beh = lp(0.55, 0.9, 0.2, 0.3), lp(0.5, 0.6, 0.4, 0.3), lp(0.25, 0.1, 0.5, 0.3)
    adv = T_([1.0, -2.0])
    for staleness, expected in ((1, -1.23), (0, 0.325)):
        kwargs = _loss_kwargs(Config(max_staleness=staleness))
        out = grpo_loss(new, old, adv, full_mask(2, 2), behavior_logprobs=beh, **kwargs)
        close(out.loss_objective, expected)
        close(out.loss, expected)
        close(out.clip_fraction, 0.5)  # t1 (A > 0, r > 1.2) and t2 (A < 0, r < 0.8) bind


def test_per_token_advantages_weigh_each_token() -> None:
    # [B, T] advantages (on-policy distillation), eps = 0.2, old = 0, mask [[1, 1, 1], [1, 1, 0]].
    # row 0: tok0 r = e^0.5 = 1.648721, A = +2 -> min(3.297443, 1.2 * 2 = 2.4) = 2.4 -> loss -2.4 (binds)
    #        tok1 r = 1, A = -0.5 -> loss +0.5
    #        tok2 r = e^-0.5 = 0.606531, A = -1 -> min(-0.606531, clip 0.8 * -1 = -0.8) = -0.8
    #             -> loss +0.8 (binds: A < 0, r < 0.8)
    # row 1: tok0 r = 1, A = 1 -> loss -1 ; tok1 r = 1, A = 0 -> loss 0 ; tok2 padding (A 7 ignored)
    # token_mean = (-2.4 + 0.5 + 0.8 - 1 + 0) / 5 = -2.1 / 5 = -0.42 ; clip_fraction = 2 / 5
    logp = T_([[0.5, 0.0, -0.5], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = T_([[2.0, -0.5, -1.0], [1.0, 0.0, 7.0]])
    out = grpo_loss(logp, torch.zeros(2, 3), adv, mask)
    close(out.loss, -0.42)
    close(out.clip_fraction, 0.4)
    out.loss.backward()
    # d/dlogp of -r * A / 5 where unclipped: row 0 tok1 -(-0.5) * 1 / 5 = 0.1; row 1 tok0 -1 / 5 = -0.2
    assert torch.allclose(logp.grad, T_([[0.0, 0.1, 0.0], [-0.2, 0.0, 0.0]]))
    # a [B] advantage is the same as that value on every token of its row
    same = grpo_loss(logp.detach(), torch.zeros(2, 3), T_([1.5, -1.0]), mask)
    tiled = grpo_loss(logp.detach(), torch.zeros(2, 3), T_([[1.5] * 3, [-1.0] * 3]), mask)
    close(same.loss, tiled.loss.item())


def test_argument_edges() -> None:
    # norm_const 1 is a valid normaliser (only <= 0 is not); one negative eps is enough to refuse
    one = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = grpo_loss(
        one, one, torch.tensor([1.0]), mask, aggregation="seq_mean_token_sum_norm", norm_const=1.0
    )
    assert out.loss.item() == pytest.approx(-2.0)  # on policy, A = 1: (-1 - 1) / 1, one sequence
    for eps in ({"eps_low": -0.1, "eps_high": 0.2}, {"eps_low": 0.2, "eps_high": -0.1}):
        with pytest.raises(ValueError, match="eps_low/eps_high must be >= 0"):
            grpo_loss(one, one, torch.tensor([1.0]), mask, **eps)
