"""Tests for the advantage oracle (tests/core/advantages_oracle.py): hand-worked examples plus hypothesis properties.

Every expected value below is worked out by hand (arithmetic in the comments); ``math.sqrt`` is
only used to spell out a square root that the comment derives.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.advantages_oracle import group_advantages, group_stats

NAN = float("nan")
PROPS = settings(max_examples=50, deadline=None)


def t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-9) -> None:
    assert actual.tolist() == pytest.approx(expected, abs=tol, nan_ok=True)


# ---------------------------------------------------------------- estimators by hand


def test_grpo_one_group_sample_and_population_std_with_eps() -> None:
    # mean = 0.5, deviations +-0.5, sum of squares = 4 * 0.25 = 1, sample var = 1/3,
    # std = sqrt(1/3) = 0.5773502691896258; adv = 0.5 / (0.5773502691896258 + 1e-6)
    # = 0.8660254037844386 * (1 - 1e-6 / 0.57735...) ~= 0.8660254037844 - 1.5e-6 = 0.8660239037870
    adv = group_advantages(t([1, 0, 0, 1]), ids([0, 0, 0, 0]))
    close(adv, [0.8660239037870, -0.8660239037870, -0.8660239037870, 0.8660239037870], tol=1e-12)
    # ddof=0: population var = 1 / 4, std = 0.5; adv = 0.5 / (0.5 + 1e-6) = 1 / (1 + 2e-6) = 0.999998000004
    adv = group_advantages(t([1, 0, 0, 1]), ids([0, 0, 0, 0]), ddof=0)
    close(adv, [0.999998000004, -0.999998000004, -0.999998000004, 0.999998000004], tol=1e-12)


def test_grpo_two_groups_group_scale_eps0() -> None:
    # group 0 = [1, 2, 3]: mean 2, sample var = (1 + 0 + 1) / 2 = 1, std 1 -> [-1, 0, 1]
    # group 1 = [10, 20]: mean 15, sample var = (25 + 25) / 1 = 50 -> +-5 / sqrt(50) = +-0.70710678
    adv = group_advantages(t([1, 2, 3, 10, 20]), ids([0, 0, 0, 1, 1]), eps=0.0)
    close(adv, [-1.0, 0.0, 1.0, -0.7071067811865476, 0.7071067811865476])


def test_grpo_batch_scale() -> None:
    # batch mean = 36 / 5 = 7.2; deviations -6.2, -5.2, -4.2, 2.8, 12.8
    # squares 38.44 + 27.04 + 17.64 + 7.84 + 163.84 = 254.8; ddof=1: 254.8 / 4 = 63.7
    # std = sqrt(63.7) = 7.98122797569; group-centred [-1, 0, 1, -5, 5] / 7.98122797569
    # 1 / 7.98122797569 = 0.12529400276, 5 / 7.98122797569 = 0.62647001379
    adv = group_advantages(t([1, 2, 3, 10, 20]), ids([0, 0, 0, 1, 1]), scale="batch", eps=0.0)
    close(adv, [-0.12529400276, 0.0, 0.12529400276, -0.62647001379, 0.62647001379], tol=1e-10)
    # ddof=0: 254.8 / 5 = 50.96, std = sqrt(50.96) = 7.13862731903
    adv0 = group_advantages(t([1, 2, 3, 10, 20]), ids([0, 0, 0, 1, 1]), scale="batch", ddof=0, eps=0.0)
    s = math.sqrt(50.96)
    close(adv0, [-1 / s, 0.0, 1 / s, -5 / s, 5 / s])


def test_grpo_scale_none_equals_drgrpo() -> None:
    # group 0 mean 2 -> [-1, 0, 1]; group 1 mean 15 -> [-5, 5]; no division
    r, g = t([1, 2, 3, 10, 20]), ids([0, 0, 0, 1, 1])
    close(group_advantages(r, g, scale="none"), [-1, 0, 1, -5, 5])
    close(group_advantages(r, g, estimator="drgrpo"), [-1, 0, 1, -5, 5])
    # drgrpo never divides, whatever scale/ddof say
    close(group_advantages(r, g, estimator="drgrpo", scale="batch", ddof=0), [-1, 0, 1, -5, 5])


def test_rloo_by_hand() -> None:
    # [1, 2, 4]: 1 - (2+4)/2 = -2; 2 - (1+4)/2 = -0.5; 4 - (1+2)/2 = 2.5
    # [3, 7] (group of two: r_i - r_j): 3 - 7 = -4; 7 - 3 = 4
    adv = group_advantages(t([1, 2, 4, 3, 7]), ids([5, 5, 5, 9, 9]), estimator="rloo")
    close(adv, [-2.0, -0.5, 2.5, -4.0, 4.0])


def test_string_and_list_group_ids() -> None:
    # "b" = {1, 3}: mean 2 -> -1, +1;  "a" = {5, 7}: mean 6 -> -1, +1
    adv = group_advantages(t([1, 5, 3, 7]), ["b", "a", "b", "a"], estimator="drgrpo")
    close(adv, [-1.0, -1.0, 1.0, 1.0])
    # sample std of {1, 3} = sqrt((1 + 1) / 1) = sqrt(2) -> grpo eps=0: -+1/sqrt(2)
    adv = group_advantages(t([1, 5, 3, 7]), ["b", "a", "b", "a"], eps=0.0)
    h = 1 / math.sqrt(2)
    close(adv, [-h, -h, h, h])
    # plain lists; ids 7 and -3; group 7 = {1, 5}: mean 3 -> -2, +2; group -3 = {4}: single -> 0
    close(group_advantages([1.0, 4.0, 5.0], [7, -3, 7], estimator="drgrpo"), [-2.0, 0.0, 2.0])


# ---------------------------------------------------------------- degenerate groups


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_of_one_is_zero(estimator: str, scale: str) -> None:
    # singletons with ddof=1 would be 0/0 in a naive sample std; here: exactly 0, never NaN
    adv = group_advantages(t([3.0, -2.0, 0.25]), ids([0, 1, 2]), estimator=estimator, scale=scale, eps=0.0)
    assert adv.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_group_is_exactly_zero(estimator: str, dtype: torch.dtype) -> None:
    # naive float64 means are off: (0.7 + 0.7 + 0.7) / 3 = 0.6999999999999998, and
    # sum([0.1] * 10) / 10 = 0.09999999999999999, so (r - mean) / (std + eps) would be non-zero
    assert sum([0.7] * 3) / 3 != 0.7 and sum([0.1] * 10) / 10 != 0.1
    r = torch.tensor([0.7] * 3 + [0.1] * 10 + [1.0, 2.0], dtype=dtype)
    g = ids([0] * 3 + [1] * 10 + [2, 2])
    adv = group_advantages(r, g, estimator=estimator)
    assert (adv[:13] == 0.0).all()  # exact, not approx
    assert (adv[13:] != 0.0).all()
    _, mean, std = group_stats(r, g)
    assert (std[:13] == 0.0).all()
    assert mean[:3].tolist() == [float(torch.tensor(0.7, dtype=dtype))] * 3


# ---------------------------------------------------------------- null (NaN) rewards


def test_null_rewards_excluded_from_group_stats() -> None:
    # group 0 non-null {1, 3}: n 2, mean 2, sample std sqrt((1 + 1) / 1) = sqrt(2)
    # group 1 non-null {5}: n 1 -> advantage 0; NaN rows -> NaN advantage
    r, g = t([1, NAN, 3, 5, NAN]), ids([0, 0, 0, 1, 1])
    h = 1 / math.sqrt(2)  # (1 - 2) / sqrt(2) = -0.70710678
    close(group_advantages(r, g, eps=0.0), [-h, NAN, h, 0.0, NAN])
    size, mean, std = group_stats(r, g)
    assert size.tolist() == [2, 2, 2, 1, 1] and size.dtype == torch.int64
    assert mean.tolist() == [2.0, 2.0, 2.0, 5.0, 5.0] and mean.dtype == torch.float64
    close(std, [math.sqrt(2)] * 3 + [0.0, 0.0])


def test_null_rewards_rloo_and_all_null_group() -> None:
    # {1, 2, 4} non-null: 1 - 3 = -2; 2 - 2.5 = -0.5; 4 - 1.5 = 2.5; group 8 all null -> NaN
    r, g = t([1, NAN, 2, 4, NAN, NAN]), ids([0, 0, 0, 0, 8, 8])
    close(group_advantages(r, g, estimator="rloo"), [-2.0, NAN, -0.5, 2.5, NAN, NAN])
    size, mean, std = group_stats(r, g)
    assert size.tolist()[4:] == [0, 0]
    assert torch.isnan(mean[4:]).all() and torch.isnan(std[4:]).all()


def test_null_rewards_excluded_from_batch_std() -> None:
    # non-null batch {0, 4, 10}: mean 14/3 = 4.6667; squares 21.7778 + 0.4444 + 28.4444 = 50.6667
    # ddof=1: 50.6667 / 2 = 25.3333, std = 5.03322296; group 0 {0, 4}: mean 2 -> -+2 / 5.0332 = -+0.39736
    # group 1 {10} is a singleton -> 0
    adv = group_advantages(t([0, 4, NAN, 10]), ids([0, 0, 0, 1]), scale="batch", eps=0.0)
    close(adv, [-0.39735970712, 0.39735970712, NAN, 0.0], tol=1e-10)


# ---------------------------------------------------------------- dtypes, shapes, errors


def test_dtypes_and_empty() -> None:
    assert group_advantages(torch.tensor([1.0, 2.0]), ids([0, 0])).dtype == torch.float32
    assert group_advantages(torch.tensor([1.0, 2.0], dtype=torch.float16), ids([0, 0])).dtype == torch.float16
    assert group_advantages(torch.tensor([1, 2]), ids([0, 0])).dtype == torch.float64
    empty = group_advantages(torch.zeros(0), ids([]))
    assert empty.shape == (0,)
    size, mean, std = group_stats([], [])
    assert size.shape == mean.shape == std.shape == (0,)


def test_bad_inputs() -> None:
    for kwargs, match in [
        ({"estimator": "ppo"}, "unknown estimator"),
        ({"scale": "global"}, "unknown scale"),
    ]:
        with pytest.raises(ValueError, match=match):
            group_advantages(t([1, 2]), ids([0, 0]), **kwargs)
    with pytest.raises(ValueError, match="eps"):
        group_advantages(t([1, 2]), ids([0, 0]), eps=-1.0)
    with pytest.raises(ValueError, match="length mismatch"):
        group_advantages(t([1, 2, 3]), ids([0, 0]))
    with pytest.raises(ValueError, match="rewards must be a 1-D"):
        group_advantages(torch.zeros(2, 2), ids([0, 0]))
    with pytest.raises(ValueError, match="group_ids must be 1-D"):
        group_advantages(t([1, 2]), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer dtype"):
        group_advantages(t([1, 2]), torch.zeros(2))
    with pytest.raises(ValueError, match="all str or all int"):
        group_advantages(t([1, 2]), ["a", None])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="finite or NaN"):
        group_advantages(t([1, float("inf")]), ids([0, 0]))
    with pytest.raises(ValueError, match="ddof"):
        group_stats(t([1, 2]), ids([0, 0]), ddof=2)


# ---------------------------------------------------------------- hypothesis properties

# rewards on a quarter grid: sums and shifts are exact in float64, ties (constant groups) are common
GRID = st.integers(-40, 40).map(lambda k: k / 4)
ROWS = st.lists(st.tuples(st.integers(0, 4), GRID), min_size=1, max_size=30)
ESTIMATOR = st.sampled_from(["grpo", "drgrpo", "rloo"])
SCALE = st.sampled_from(["group", "batch", "none"])
Rows = list[tuple[int, float]]


def split(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    return ids([g for g, _ in rows]), t([r for _, r in rows])


@PROPS
@given(rows=ROWS, estimator=ESTIMATOR, scale=SCALE)
def test_prop_advantages_sum_to_zero_per_group(rows: Rows, estimator: str, scale: str) -> None:
    g, r = split(rows)
    adv = group_advantages(r, g, estimator=estimator, scale=scale)
    assert not torch.isnan(adv).any()
    for k in g.unique().tolist():
        assert abs(float(adv[g == k].sum())) < 1e-9


@PROPS
@given(rows=ROWS, estimator=ESTIMATOR, scale=SCALE, data=st.data())
def test_prop_invariant_to_per_group_shift(
    rows: Rows, estimator: str, scale: str, data: st.DataObject
) -> None:
    g, r = split(rows)
    # one constant per group id 0..4; with the batch std only a shift of the whole batch is neutral
    shifts = t(data.draw(st.lists(GRID, min_size=5, max_size=5)))
    shifts = shifts[:1].expand(5) if scale == "batch" else shifts  # [5]
    base = group_advantages(r, g, estimator=estimator, scale=scale)
    shifted = group_advantages(r + shifts[g], g, estimator=estimator, scale=scale)
    close(shifted, base.tolist())


@PROPS
@given(rows=ROWS, estimator=ESTIMATOR, scale=SCALE, data=st.data())
def test_prop_invariant_to_row_permutation(
    rows: Rows, estimator: str, scale: str, data: st.DataObject
) -> None:
    g, r = split(rows)
    perm = torch.tensor(data.draw(st.permutations(range(len(rows)))), dtype=torch.int64)
    base = group_advantages(r, g, estimator=estimator, scale=scale)
    permuted = group_advantages(r[perm], g[perm], estimator=estimator, scale=scale)
    close(permuted, base[perm].tolist())


@PROPS
@given(rows=ROWS, estimator=ESTIMATOR, scale=SCALE, data=st.data())
def test_prop_null_rows_do_not_change_other_rows(
    rows: Rows, estimator: str, scale: str, data: st.DataObject
) -> None:
    g, r = split(rows)
    null_groups = data.draw(st.lists(st.integers(0, 6), max_size=5))  # may hit new or existing groups
    g2, r2 = torch.cat([g, ids(null_groups)]), torch.cat([r, t([NAN] * len(null_groups))])
    adv = group_advantages(r2, g2, estimator=estimator, scale=scale)
    close(adv[: len(rows)], group_advantages(r, g, estimator=estimator, scale=scale).tolist())
    assert torch.isnan(adv[len(rows) :]).all()


@PROPS
@given(rows=ROWS)
def test_prop_constant_groups_exactly_zero_and_stats_consistent(rows: Rows) -> None:
    g, r = split(rows)
    size, mean, std = group_stats(r, g)
    adv = group_advantages(r, g)
    for k in g.unique().tolist():
        m = g == k
        assert (size[m] == int(m.sum())).all()
        if bool(r[m].min() == r[m].max()):
            assert (adv[m] == 0.0).all() and (std[m] == 0.0).all() and (mean[m] == r[m][0]).all()
        else:
            assert (std[m] > 0).all()
