"""Eval results leave the manifest: trackers, the eval_metrics view, run's summary, eval.png; and
correctness is judged by one reward function, so a length penalty does not make every answer wrong."""

import json
from pathlib import Path

import pytest

from rlhf_batch.commands.pipeline import print_eval_summary
from rlhf_batch.observe import tracking
from rlhf_batch.observe.query import connect
from rlhf_batch.stages.evaluate import Eval
from rlhf_batch.stages.executor import execute
from rlhf_batch.store import layout


def carried_value(*, value: list[float], **_: object) -> list[float]:
    """The prompt's own `value` column: every sample of a prompt scores the same."""
    return list(value)


def length_penalty(*, responses: list[str], **_: object) -> list[float]:
    return [-0.01 * (1 + len(r)) for r in responses]  # always < 0


ROWS = [
    {"id": "p0", "prompt": "a*1=", "value": 1.0, "data_source": "left"},
    {"id": "p1", "prompt": "b*1=", "value": 0.0, "data_source": "left"},
    {"id": "p2", "prompt": "c*1=", "value": 1.0, "data_source": "right"},
]
HERE = "tests.stages.test_eval_metrics_out"


def config(make_config, tmp_path: Path, **eval_keys):  # noqa: ANN201
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    table = {
        "prompts": str(data),
        "n": 2,
        "k": [1],
        "reward_functions": [f"{HERE}:carried_value", f"{HERE}:length_penalty"],
        **eval_keys,
    }
    return make_config(eval=table)


def test_correctness_is_judged_by_the_first_function_not_the_weighted_sum(
    make_config, tmp_path: Path
) -> None:
    _, cfg = config(make_config, tmp_path)
    m = execute(Eval(cfg, 0), quiet=True)
    # carried_value judges: p0 and p2 correct (1.0 >= 1.0), p1 not; the penalty only lowers rewards
    # pass@1: left (1 + 0) / 2 = 0.5, right 1.0, overall (1 + 0 + 1) / 3 = 2/3
    assert m["correct_function"] == f"{HERE}:carried_value"
    assert m["metrics"]["left"]["pass@1"] == 0.5 and m["metrics"]["right"]["pass@1"] == 1.0
    assert m["overall"]["pass@1"] == pytest.approx(2 / 3)
    assert m["overall"]["mean@2"] < 2 / 3  # the weighted sum, penalty included
    _, other = make_config(name="b.toml", eval={**cfg.eval.__dict__, "correct_function": "length_penalty"})
    assert execute(Eval(other, 0), quiet=True, force=True)["overall"]["pass@1"] == 0.0


def test_overall_reaches_the_view_the_summary_and_the_trackers(make_config, tmp_path: Path, capsys) -> None:
    _, cfg = config(make_config, tmp_path)
    m = execute(Eval(cfg, 0), quiet=True)
    con = connect(Path(cfg.run_dir))
    rows = con.sql(
        "SELECT data_source, metric, value FROM eval_metrics WHERE metric = 'pass@1' ORDER BY 1"
    ).fetchall()
    assert rows == [
        ("left", "pass@1", 0.5),
        ("overall", "pass@1", pytest.approx(2 / 3)),
        ("right", "pass@1", 1.0),
    ]
    print_eval_summary(cfg)
    out = capsys.readouterr().out
    assert "eval    0  overall: mean@2" in out and "pass@1 0.6667" in out
    numbers = tracking.headline(layout.folder(cfg.run_dir, 0, "eval"), m)
    assert (
        numbers["overall/pass_at_1"] == pytest.approx(2 / 3)
        and numbers["left/mean_at_2"] == m["metrics"]["left"]["mean@2"]
    )
