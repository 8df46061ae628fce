"""A reward function's arguments are checked against the data's columns before anything is scored."""

from pathlib import Path

import pytest

from rlhf_batch.errors import ConfigError
from rlhf_batch.rewards import load_reward_functions
from rlhf_batch.rewards.conventions import argument_problem
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout

HERE = "tests.rewards.test_arguments"
DATA = Path(__file__).parent.parent / "data"


def needs_answer(*, prompts, responses, answer, **_):  # noqa: ANN001, ANN201
    return [float(r == a) for r, a in zip(responses, answer, strict=True)]


def trl_needs_solution(prompts, completions, solution, **kwargs):  # noqa: ANN001, ANN201 - TRL's accuracy_reward
    return [0.0] * len(completions)


def no_kwargs(*, prompts, responses):  # noqa: ANN001, ANN201
    return [0.0] * len(responses)


def verl_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201 - verl's
    return 1.0


def fn(path: str):  # noqa: ANN201
    return load_reward_functions([path])[0]


@pytest.mark.parametrize(
    ("path", "columns", "needle"),
    [
        (
            f"{HERE}:needs_answer",
            ["letter", "count"],
            "needs argument 'answer', which no column of the prompt data gives (columns: letter, count)",
        ),
        (f"trl:{HERE}:trl_needs_solution", ["answer"], "needs argument 'solution'"),
        (f"verl:{HERE}:verl_score", ["answer"], "needs verl field 'data_source', 'ground_truth'"),
        (f"verl:{HERE}:verl_score", ["data_source"], "needs verl field 'ground_truth', which no column"),
        (
            f"{HERE}:no_kwargs",
            ["letter"],
            "does not take argument 'letter', 'prompt_ids', 'response_ids', which score passes; add **kwargs",
        ),
    ],
)
def test_argument_problems_name_the_function_the_argument_and_the_columns(
    path: str, columns: list[str], needle: str
) -> None:
    problem = argument_problem(fn(path), columns)
    assert problem is not None and needle in problem and path in problem


@pytest.mark.parametrize(
    ("path", "columns"),
    [
        (f"{HERE}:needs_answer", ["answer"]),
        (f"trl:{HERE}:trl_needs_solution", ["solution", "prompt_messages"]),
        (f"verl:{HERE}:verl_score", ["data_source", "ground_truth"]),  # extra_info has a default
        ("rlhf_batch.rewards.demo:letter_count", ["letter", "count"]),
    ],
)
def test_functions_whose_arguments_have_columns_pass(path: str, columns: list[str]) -> None:
    assert argument_problem(fn(path), columns) is None


def test_score_fails_before_scoring_any_rollout(make_config) -> None:
    _, cfg = make_config(
        score={"reward_functions": [f"verl:{HERE}:verl_score"]}
    )  # demo prompts: no ground truth
    run_stage("generate", cfg, 0, quiet=True)
    with pytest.raises(
        ConfigError,
        match=r"verl_score needs verl field 'data_source', 'ground_truth'.*columns: letter, count",
    ):
        run_stage("score", cfg, 0, quiet=True)
    assert not layout.list_parts(layout.folder(cfg.run_dir, 0, "scores"))
