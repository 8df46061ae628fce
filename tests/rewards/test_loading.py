"""Loading reward functions by import path, calling them batched, combining them by weight."""

from __future__ import annotations

import math

import pytest

from rlhf_batch.errors import ConfigError, RewardError
from rlhf_batch.rewards import call_reward_function, clip, load_reward_functions, weighted_sum

HERE = "tests.rewards.test_loading"
IDS = ["0000-p-0", "0000-p-1", "0000-p-2"]


def returns(values):
    def fn(**_):
        return values

    return fn


nan_reward = returns([1.0, math.nan, 0.0])
inf_reward = returns([1.0, 0.0, -math.inf])
short_reward = returns([1.0, 0.0])
text_reward = returns([1.0, "0.5", 0.0])
ok_reward = returns([1, None, 0.25])
letter_count = returns([0.0, 0.0, 0.0])  # same name as the demo reward


def fails_on_second_alone(*, responses, **_):
    if "boom" in responses:
        raise KeyError("boom")
    return [0.0] * len(responses)


def fails_only_batched(*, responses, **_):
    if len(responses) > 1:
        raise RuntimeError("batch too big")
    return [0.0]


def call(path: str, responses=("a", "b", "c")):
    (rf,) = load_reward_functions([path])
    return call_reward_function(
        rf,
        IDS,
        prompts=["p"] * 3,
        responses=list(responses),
        prompt_ids=[[7], [7], [7]],
        response_ids=[[1], [2], [3]],
        columns={"answer": ["x", "y", "z"]},
    )


def test_ints_and_none_pass_through_as_floats_and_none() -> None:
    assert call(f"{HERE}:ok_reward") == [1.0, None, 0.25]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nan_reward", r"returned nan for rollout 0000-p-1; expected a finite float or None"),
        ("inf_reward", r"returned -inf for rollout 0000-p-2"),
        ("text_reward", r"returned '0.5' for rollout 0000-p-1"),
        ("short_reward", r"returned 2 values for 3 rollouts"),
    ],
)
def test_bad_values_are_errors_naming_the_function(name: str, message: str) -> None:
    with pytest.raises(RewardError, match=rf"reward function {HERE}:{name} {message}"):
        call(f"{HERE}:{name}")


def test_a_raising_function_is_reported_with_the_failing_rollout() -> None:
    with pytest.raises(
        RewardError, match=rf"{HERE}:fails_on_second_alone raised KeyError: 'boom' \(rollout 0000-p-1\)"
    ):
        call(f"{HERE}:fails_on_second_alone", responses=("a", "boom", "c"))
    with pytest.raises(RewardError, match=r"\(rollout 0000-p-0..0000-p-2, fails only on the whole batch\)"):
        call(f"{HERE}:fails_only_batched")


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        (["rlhf_batch.rewards.demo.letter_count"], "is not of the form 'package.module:function'"),
        (["no_such_package.rewards:f"], "cannot import 'no_such_package.rewards'"),
        (["rlhf_batch.rewards.demo:nope"], "has no attribute 'nope'"),
        (["rlhf_batch.rewards:RM_COLUMN"], "is not callable"),
        ([f"{HERE}:ok_reward", f"{HERE}.ok_reward"], f"'{HERE}.ok_reward' is not of the form"),
    ],
)
def test_bad_paths_are_config_errors_naming_the_path(paths: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_reward_functions(paths)


def test_two_functions_with_the_same_name_take_their_module_names_or_an_alias() -> None:
    fns = load_reward_functions(["rlhf_batch.rewards.demo:letter_count", f"{HERE}:letter_count"])
    assert [f.column for f in fns] == ["reward_demo_letter_count", "reward_test_loading_letter_count"]
    fns = load_reward_functions(["rlhf_batch.rewards.demo:letter_count as letters", f"{HERE}:letter_count"])
    assert [f.column for f in fns] == ["reward_letters", "reward_letter_count"]
    assert fns[0].fn is load_reward_functions(["rlhf_batch.rewards.demo:letter_count"])[0].fn
    with pytest.raises(ConfigError, match="the name after 'as' must be an identifier"):
        load_reward_functions(["rlhf_batch.rewards.demo:letter_count as two words"])


def test_columns_that_still_clash_or_are_reserved_are_errors() -> None:
    with pytest.raises(
        ConfigError,
        match="would write column 'reward_demo_letter_count', as does 'rlhf_batch.rewards.*'MODULE:FUNCTION as NAME'",
    ):
        load_reward_functions(
            ["rlhf_batch.rewards.demo:letter_count", "rlhf_batch.rewards.demo:letter_count"]
        )
    with pytest.raises(ConfigError, match="would write column 'reward_raw', as does a column of the scores"):
        load_reward_functions([f"{HERE}:raw"], reserved=["reward_raw", "score"])


raw = returns([0.0, 0.0, 0.0])  # a function whose column would be 'reward_raw'


def test_weights_default_to_one_and_must_match() -> None:
    assert [rf.weight for rf in load_reward_functions([f"{HERE}:ok_reward", f"{HERE}:nan_reward"])] == [
        1.0,
        1.0,
    ]
    with pytest.raises(ConfigError, match="1 weights for 2 reward_functions"):
        load_reward_functions([f"{HERE}:ok_reward", f"{HERE}:nan_reward"], [2.0])


def test_weighted_sum_and_clip_by_hand() -> None:
    values = {"reward_a": [1.0, 0.5, None], "reward_b": [2.0, -1.0, 3.0]}
    # row 0: 2 * 1 - 0.5 * 2 = 1; row 1: 2 * 0.5 - 0.5 * -1 = 1.5; row 2: a is None -> None
    assert weighted_sum(values, {"reward_a": 2.0, "reward_b": -0.5}, 3) == [1.0, 1.5, None]
    assert [clip(x, 1.2) for x in (1.0, 1.5, -3.0, None)] == [1.0, 1.2, -1.2, None]
    assert clip(-3.0, 0.0) == -3.0  # 0 disables
