"""Tests for rlhf_batch.core.supervised (SFT's cross-entropy, DPO and IPO over pairs) and
rlhf_batch.core.objective_schedule. Expected values are worked out by hand in the comments, or
with TRL's DPOTrainer formulas written out below in plain Python (`math`, not torch)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_batch.core.objective_schedule import objective_at, parse_schedule, uses
from rlhf_batch.core.supervised import dpo_loss, preference_losses, sft_loss

T_ = torch.tensor
NAN = float("nan")


def trl_dpo(
    pc: float, pr: float, rc: float, rr: float, beta: float, loss_type: str, nc: int, nr: int
) -> float:
    """TRL's DPOTrainer._compute_loss for one pair (f_divergence_type "reverse_kl", no label
    smoothing, no ld_alpha): sigmoid -logsigmoid(beta * delta); ipo (delta' - 1 / (2 beta))^2 with
    each side's log-ratio divided by its completion tokens."""
    chosen, rejected = pc - rc, pr - rr
    if loss_type == "sigmoid":
        x = beta * (chosen - rejected)
        return math.log1p(math.exp(-x))  # -log sigmoid(x)
    return (chosen / nc - rejected / nr - 1 / (2 * beta)) ** 2


def test_sft_loss_is_the_token_cross_entropy_over_the_mask_by_hand() -> None:
    logp = T_([[-1.0, -2.0, NAN], [-0.5, -4.0, -3.0]], requires_grad=True)
    mask = T_([[True, True, False], [True, False, True]])  # row 1's middle token: the environment's
    out = sft_loss(logp, logp.detach(), mask)
    # -(-1 - 2 - 0.5 - 3) / 4 tokens = 6.5 / 4 = 1.625
    assert out.loss.item() == pytest.approx(1.625)
    assert out.loss_objective.item() == pytest.approx(1.625)
    out.loss.backward()
    # d/dlogp: -1/4 on each masked token, 0 elsewhere (the NaN padding included)
    assert logp.grad.tolist() == [[-0.25, -0.25, 0.0], [-0.25, 0.0, -0.25]]
    # the step's normaliser instead of the local count: 6.5 / 10
    assert sft_loss(logp, logp.detach(), mask, denominator=10.0).loss.item() == pytest.approx(0.65)


def test_sigmoid_dpo_by_hand() -> None:
    # pair: policy chosen -3, rejected -5; reference chosen -4, rejected -4; beta 0.1
    # delta = (-3 + 4) - (-5 + 4) = 2; loss = -log sigmoid(0.2) = log(1 + e^-0.2) = log(1.818731) = 0.598139
    got = preference_losses(T_([-3.0]), T_([-5.0]), T_([-4.0]), T_([-4.0]), 0.1)
    assert got.item() == pytest.approx(0.598139, abs=1e-6)
    assert got.item() == pytest.approx(trl_dpo(-3, -5, -4, -4, 0.1, "sigmoid", 1, 1), abs=1e-6)


def test_ipo_by_hand_divides_each_side_by_its_tokens() -> None:
    # chosen: policy -3, ref -4 over 2 tokens: 1 / 2 = 0.5; rejected: policy -5, ref -4 over 4 tokens:
    # -1 / 4 = -0.25; delta' = 0.75; beta 0.5: 1 / (2 beta) = 1; loss (0.75 - 1)^2 = 0.0625
    got = preference_losses(T_([-3.0]), T_([-5.0]), T_([-4.0]), T_([-4.0]), 0.5, "ipo", T_([2.0]), T_([4.0]))
    assert got.item() == pytest.approx(0.0625)
    assert got.item() == pytest.approx(trl_dpo(-3, -5, -4, -4, 0.5, "ipo", 2, 4))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_over_rows_equals_trls_per_pair_mean(loss_type: str, beta: float) -> None:
    """Rows [chosen 0, rejected 0, chosen 1, rejected 1] with padding (NaN) and an unsampled token."""
    logp = T_(
        [
            [-0.5, -1.0, NAN],  # chosen 0: 2 tokens, sum -1.5
            [-2.0, -1.0, -0.5],  # rejected 0: 3 tokens, sum -3.5
            [-1.0, -9.0, -0.25],  # chosen 1: its middle token is the environment's: sum -1.25 over 2
            [-3.0, NAN, NAN],  # rejected 1: 1 token, sum -3
        ]
    )
    ref = T_(
        [
            [-1.0, -1.0, NAN],  # sum -2
            [-1.0, -1.0, -1.0],  # sum -3
            [-0.5, -7.0, -0.5],  # sum over the mask -1
            [-1.0, NAN, NAN],  # sum -1
        ]
    )
    mask = T_([[1, 1, 0], [1, 1, 1], [1, 0, 1], [1, 0, 0]]).bool()
    want = [
        trl_dpo(-1.5, -3.5, -2.0, -3.0, beta, loss_type, 2, 3),
        trl_dpo(-1.25, -3.0, -1.0, -1.0, beta, loss_type, 2, 1),
    ]
    out = dpo_loss(logp, logp, ref, mask, beta=beta, loss_type=loss_type)
    assert out.loss.item() == pytest.approx(sum(want) / 2, rel=1e-6)
    # the step's pairs as the normaliser: the sum over 5 pairs
    out = dpo_loss(logp, logp, ref, mask, beta=beta, loss_type=loss_type, denominator=5.0)
    assert out.loss.item() == pytest.approx(sum(want) / 5, rel=1e-6)


def test_dpo_at_the_reference_is_log_two_and_pushes_chosen_up() -> None:
    logp = T_([[-1.0, -2.0], [-1.5, -1.5]], requires_grad=True)
    out = dpo_loss(logp, logp.detach(), logp.detach(), torch.ones(2, 2, dtype=torch.bool), beta=0.1)
    assert out.loss.item() == pytest.approx(math.log(2))  # delta 0: -log sigmoid(0)
    out.loss.backward()
    # d/d pi_chosen = -beta * sigmoid(-0) = -0.05 per token; rejected +0.05
    assert logp.grad.flatten().tolist() == pytest.approx([-0.05, -0.05, 0.05, 0.05])


def test_metrics_compare_with_the_behaviour_log_probs() -> None:
    logp = T_([[0.0, math.log(2.0)]])
    out = sft_loss(logp, T_([[0.0, 0.0]]), torch.ones(1, 2, dtype=torch.bool))
    # ratios 1 and 2: mean 1.5; k3 r - 1 - log r: 0 and 1 - log 2 = 0.306853, mean 0.153426
    assert out.ratio_mean.item() == pytest.approx(1.5)
    assert out.kl_approx.item() == pytest.approx(0.153426, abs=1e-6)
    assert out.clip_fraction.item() == 0.0 and out.loss_kl_to_ref.item() == 0.0


def test_bad_pairs_and_losses_are_refused() -> None:
    mask = torch.ones(3, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="even number of rows"):
        dpo_loss(torch.zeros(3, 1), torch.zeros(3, 1), torch.zeros(3, 1), mask, beta=0.1)
    with pytest.raises(ValueError, match="unknown preference loss"):
        preference_losses(T_([0.0]), T_([0.0]), T_([0.0]), T_([0.0]), 0.1, "hinge")
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_losses(T_([0.0]), T_([0.0]), T_([0.0]), T_([0.0]), 0.0)


def test_objective_schedules() -> None:
    warm = parse_schedule(["sft:3", "grpo"])
    assert [objective_at(warm, k) for k in range(6)] == ["sft", "sft", "sft", "grpo", "grpo", "grpo"]
    cycle = parse_schedule(["sft:1", "dpo:2"])  # every entry counted: it repeats
    assert [objective_at(cycle, k) for k in range(7)] == ["sft", "dpo", "dpo", "sft", "dpo", "dpo", "sft"]
    assert [objective_at(parse_schedule("dpo"), k) for k in (0, 9)] == ["dpo", "dpo"]
    assert uses(warm, "sft") and not uses(warm, "dpo")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "must name an objective"),
        ("ppo", "must be one of grpo, sft, dpo"),
        (["sft", "grpo"], "only the last entry may"),
        (["sft:0", "grpo"], "whole number >= 1"),
        (["sft:x"], "whole number >= 1"),
        ([3], "is not a string"),
    ],
)
def test_bad_schedules_say_why(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_schedule(value)  # type: ignore[arg-type]
