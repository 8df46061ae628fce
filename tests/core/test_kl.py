"""Tests for rlhf_batch.core.kl: estimators and controllers, worked by hand, plus properties."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_batch.core.kl import (
    AdaptiveKLController,
    ConstantKLController,
    bounded_k3,
    controller_from_state,
    kl_estimate,
    kl_shaped_reward,
    make_controller,
    sequence_kl,
)

PROPS = settings(max_examples=50, deadline=None)
LOGP = st.floats(-50.0, 0.0, allow_nan=False)


def t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# ---------------------------------------------------------------- estimators


def test_estimators_by_hand() -> None:
    # logp = -1, ref = -2: d = ref - logp = -1
    # k1 = logp - ref = 1; k2 = 0.5 * (-1)^2 = 0.5; k3 = exp(-1) - (-1) - 1 = exp(-1) = 0.36787944117
    logp, ref = t([-1.0]), t([-2.0])
    assert kl_estimate(logp, ref, "k1").item() == 1.0
    assert kl_estimate(logp, ref, "k2").item() == 0.5
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.36787944117144233, rel=1e-12)
    # swapped: d = +1 -> k1 = -1; k2 = 0.5; k3 = e - 1 - 1 = 0.71828182846
    assert kl_estimate(ref, logp, "k1").item() == -1.0
    assert kl_estimate(ref, logp, "k2").item() == 0.5
    assert kl_estimate(ref, logp, "k3").item() == pytest.approx(0.7182818284590451, rel=1e-12)


def test_k3_estimate_is_bounded_k1_k2_are_not() -> None:
    # logp = -15, ref = 0: d = 15. k3 = e^15 - 16 ~ 3.27e6 -> clamped to 10;
    # k1 = logp - ref = -15 ; k2 = 0.5 * 15^2 = 112.5 (no clamp)
    logp, ref = torch.tensor(-15.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    assert kl_estimate(logp, ref, "k3").item() == 10.0
    assert kl_estimate(logp, ref, "k1").item() == -15.0
    assert kl_estimate(logp, ref, "k2").item() == 112.5
    # d = 2.3: e^2.3 - 3.3 = 9.974182455 - 3.3 = 6.674182455, below the bound
    assert kl_estimate(
        torch.tensor(0.0, dtype=torch.float64), torch.tensor(2.3, dtype=torch.float64), "k3"
    ).item() == (pytest.approx(6.674182455, rel=1e-9))


def test_default_estimator_is_k1_and_any_shape() -> None:
    # k1 = logp - ref elementwise; 0-D and [2, 1, 2] shapes are preserved
    assert kl_estimate(torch.tensor(-0.5), torch.tensor(-1.5)).item() == 1.0
    logp = t([-1.0, -2.0, -3.0, -4.0]).reshape(2, 1, 2)
    ref = t([-1.0, -1.0, -1.0, -1.0]).reshape(2, 1, 2)
    for est in ("k1", "k2", "k3"):
        assert kl_estimate(logp, ref, est).shape == (2, 1, 2)
    # k2 = 0.5 * (0, 1, 4, 9) = (0, 0.5, 2, 4.5)
    assert kl_estimate(logp, ref, "k2").flatten().tolist() == [0.0, 0.5, 2.0, 4.5]


def test_estimators_unbiased_in_expectation_on_a_discrete_distribution() -> None:
    # pi = (1/2, 1/4, 1/4), ref = (1/4, 1/2, 1/4)
    # KL(pi || ref) = 1/2 ln 2 + 1/4 ln(1/2) + 1/4 ln 1 = 1/4 ln 2 = 0.17328679514
    # E_pi[k3] = sum pi (ref/pi - 1 - ln(ref/pi)) = sum ref - 1 + KL = KL; E_pi[k1] = KL by definition
    pi, ref = t([0.5, 0.25, 0.25]), t([0.25, 0.5, 0.25])
    for est in ("k1", "k3"):
        expectation = float((pi * kl_estimate(pi.log(), ref.log(), est)).sum())
        assert expectation == pytest.approx(0.17328679513998632, rel=1e-12)


def test_estimator_errors() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(t([0.0]), t([0.0]), "k4")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_estimate(t([0.0, 1.0]), t([0.0]))


@PROPS
@given(a=LOGP, b=LOGP)
def test_prop_k1_zero_exactly_when_equal(a: float, b: float) -> None:
    k1 = kl_estimate(t([a, a]), t([a, b]), "k1")
    assert k1[0].item() == 0.0
    assert (k1[1].item() == 0.0) == (a == b)
    for est in ("k2", "k3"):  # all estimators vanish exactly on equal log-probs
        assert kl_estimate(t([a]), t([a]), est).item() == 0.0


@PROPS
@given(a=LOGP, b=LOGP, dtype=st.sampled_from([torch.float32, torch.float64]))
def test_prop_k2_k3_non_negative(a: float, b: float, dtype: torch.dtype) -> None:
    logp, ref = torch.tensor([a, b], dtype=dtype), torch.tensor([b, a], dtype=dtype)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k2") >= 0).all()


# ---------------------------------------------------------------- sequence helpers


def test_sequence_kl_and_shaped_reward() -> None:
    # row 0: 1 + 2 (3 is padding) = 3; row 1: 4 (5 and NaN are padding) = 4
    kl = t([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    seq = sequence_kl(kl, mask)
    assert seq.tolist() == [3.0, 4.0]
    # score - beta * kl_sum: 1 - 0.1 * 3 = 0.7; 2 - 0.1 * 4 = 1.6
    assert kl_shaped_reward(t([1.0, 2.0]), seq, 0.1).tolist() == pytest.approx([0.7, 1.6])
    with pytest.raises(ValueError, match="bool"):
        sequence_kl(kl, mask.long())
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        sequence_kl(kl, mask[:, :2])


# ---------------------------------------------------------------- controllers


def test_constant_controller() -> None:
    ctl = ConstantKLController(0.05)
    assert ctl.update(100.0, 256) == 0.05 and ctl.value == 0.05
    assert ctl.state_dict() == {"kind": "constant", "beta": 0.05}
    back = controller_from_state(json.loads(json.dumps(ctl.state_dict())))
    assert back == ctl


def test_adaptive_above_target_by_hand() -> None:
    # error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 256 / 10000)
    # = 0.1 * 1.00512 = 0.100512; again: 0.100512 * 1.00512 = 0.100512 + 0.00051462144 = 0.10102662144
    ctl = AdaptiveKLController(init_beta=0.1, target=6.0, horizon=10000)
    assert ctl.update(9.0, 256) == pytest.approx(0.100512, rel=1e-12)
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    assert ctl.update(9.0, 256) == pytest.approx(0.10102662144, rel=1e-12)


def test_adaptive_below_and_at_target_by_hand() -> None:
    # kl = 5: error = 5/6 - 1 = -1/6 (inside the clip); beta = 0.1 * (1 - 256 / 60000)
    # = 0.1 * (1 - 0.0042666...) = 0.0995733333...
    assert AdaptiveKLController(0.1, 6.0, 10000).update(5.0, 256) == pytest.approx(0.09957333333333333)
    # kl = 0: error = clip(-1) = -0.2; beta = 0.1 * (1 - 0.00512) = 0.099488
    assert AdaptiveKLController(0.1, 6.0, 10000).update(0.0, 256) == pytest.approx(0.099488, rel=1e-12)
    # kl = target: error 0, beta unchanged exactly; n_steps = 0: unchanged exactly
    assert AdaptiveKLController(0.1, 6.0, 10000).update(6.0, 256) == 0.1
    assert AdaptiveKLController(0.1, 6.0, 10000).update(60.0, 0) == 0.1
    # 1 - 0.2 * 100 / 10 = -1 would flip the sign: floored at 0
    assert AdaptiveKLController(0.1, 6.0, 10).update(0.0, 100) == 0.0


def test_adaptive_state_json_round_trip() -> None:
    ctl = make_controller("adaptive", 0.1, target=6.0, horizon=10000)
    ctl.update(9.0, 256)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state == {
        "kind": "adaptive",
        "beta": ctl.value,
        "init_beta": 0.1,
        "target": 6.0,
        "horizon": 10000.0,
    }
    back = controller_from_state(state)
    assert isinstance(back, AdaptiveKLController) and back.value == ctl.value
    assert back.update(3.0, 128) == ctl.update(3.0, 128)  # the restored one evolves identically


def test_controller_errors() -> None:
    with pytest.raises(ValueError, match="unknown KL controller kind"):
        make_controller("pid", 0.1)
    for target, horizon in [(None, 100), (0.0, 100), (6.0, None), (6.0, -1)]:
        with pytest.raises(ValueError, match="adaptive KL controller needs"):
            make_controller("adaptive", 0.1, target=target, horizon=horizon)
    for beta in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="beta"):
            make_controller("constant", beta)
    with pytest.raises(ValueError, match="unknown KL controller kind"):
        controller_from_state({"kind": "pid", "beta": 0.1})
    with pytest.raises(ValueError, match="needs keys"):
        controller_from_state({"kind": "adaptive", "beta": 0.1})
    with pytest.raises(ValueError, match="'kind'"):
        controller_from_state({"beta": 0.1})
    with pytest.raises(ValueError, match="current_kl"):
        AdaptiveKLController(0.1, 6.0, 100).update(float("nan"), 1)
    assert make_controller("constant", 0.2, target=6.0).value == 0.2  # target/horizon ignored


@PROPS
@given(
    beta=st.floats(0.0, 10.0),
    target=st.floats(0.01, 100.0),
    kl=st.floats(-10.0, 1000.0),
    n=st.integers(0, 5000),
)
def test_prop_adaptive_moves_towards_target_within_clip(
    beta: float, target: float, kl: float, n: int
) -> None:
    ctl = AdaptiveKLController(beta, target, horizon=1000)
    new = ctl.update(kl, n)
    assert new >= 0.0
    assert (new >= beta) if kl > target else (new <= beta)
    # |multiplier - 1| <= 0.2 * n / horizon (before the floor at 0)
    assert abs(new - beta) <= beta * 0.2 * n / 1000 * (1 + 1e-12) + 1e-300
    assert math.isfinite(new)


def test_k3_keeps_float32_precision_near_equal_log_probs() -> None:
    """k3 = exp(d) - d - 1 near d = 0 in float32. By Taylor, exp(d) - d - 1 = d^2/2 + d^3/6 + O(d^4).
    d = float32(1e-4) = 9.99999974737875e-05: d^2/2 = 4.99999974737875e-09, d^3/6 = 1.6667e-13,
    k3 = 5.0001664e-09; d = -float32(1e-4): 5.0e-09 - 1.6667e-13 = 4.9998331e-09. Through expm1
    the float32 result is within ~3e-4 relative (expm1(d) - d loses ~12 of 24 bits); written as
    exp(d) - d - 1, exp(d) = 1.0001 rounds to a float32 spaced 1.2e-7 apart, and the result is 0."""
    d = torch.tensor([1e-4, -1e-4], dtype=torch.float32)
    want = [5.0001664e-09, 4.9998331e-09]
    for got in (bounded_k3(d), kl_estimate(torch.zeros(2), d, "k3")):  # d = ref_logp - logp
        assert got.dtype == torch.float32
        assert got.tolist() == pytest.approx(want, rel=1e-3)
