"""The step's effective sample size (train_step.StepMetrics): (sum w)^2 / (n sum w^2) over the
step's sequences, w = exp(sum_t (logp - old)), computed once over all micro-batches."""

import math

import torch

from rlhf_batch.core.losses import grpo_loss
from rlhf_batch.stages.train.step import StepMetrics


def ess(*batches: tuple[torch.Tensor, torch.Tensor]) -> float:
    metrics = StepMetrics("cpu")
    for logp, mask in batches:
        old = torch.zeros_like(logp)
        out = grpo_loss(logp, old, torch.zeros(len(logp)), mask)
        metrics.add(out, mask, logp, old, 1.0)
    return metrics.reduce()["ess"]


def full(b: int, t: int) -> torch.Tensor:
    return torch.ones(b, t, dtype=torch.bool)


def test_ess_equal_weights_is_one() -> None:
    # per-sequence sums of (logp - old): 0.3 + 0.2 = 0.5 and 0.5 -> equal weights -> ESS = 1
    assert math.isclose(ess((torch.tensor([[0.3, 0.2], [0.5, 0.0]]), full(2, 2))), 1.0, rel_tol=1e-9)


def test_ess_unequal_weights_over_two_micro_batches() -> None:
    # log w = [0, ln 3] -> w = [1, 3]: (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20 = 0.8, whether the two
    # sequences are in one micro-batch or in two
    h = math.log(3) / 2
    logp = torch.tensor([[0.0, 0.0], [h, h]])
    assert math.isclose(ess((logp, full(2, 2))), 0.8, rel_tol=1e-6)
    assert math.isclose(ess((logp[:1], full(1, 2)), (logp[1:], full(1, 2))), 0.8, rel_tol=1e-6)
    # an all-padding third row is not a sequence: still 0.8 (with it counted, n=3 and w=[1,3,1])
    logp3 = torch.cat([logp, torch.tensor([[5.0, 5.0]])])
    mask3 = torch.cat([full(2, 2), torch.zeros(1, 2, dtype=torch.bool)])
    assert math.isclose(ess((logp3, mask3)), 0.8, rel_tol=1e-6)


def test_ess_is_stable_for_huge_log_weights() -> None:
    # log w = [0, 20 * 80 = 1600]: w overflows float32 but ESS = (1 + e^1600)^2 / (2 (1 + e^3200)) -> 1/2
    logp = torch.cat([torch.zeros(1, 20), torch.full((1, 20), 80.0)])
    assert math.isclose(ess((logp, full(2, 20))), 0.5, rel_tol=1e-9)
