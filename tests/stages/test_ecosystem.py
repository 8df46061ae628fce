"""Prompt sets and reward functions as TRL and verl users have them, unchanged.

tests/fixtures/trl_conversational.jsonl and tests/fixtures/verl_math.parquet (written by
tests/fixtures/make_examples.py) load with no extra config keys; TRL- and verl-style reward
functions are called with those libraries' arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rlhf_batch.errors import RewardError
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS, SCORES

DATA = Path(__file__).parent.parent / "fixtures"
HERE = "tests.stages.test_ecosystem"
CALLS: list[dict[str, Any]] = []


def trl_reward(prompts, completions, completion_ids, **kwargs):  # noqa: ANN001, ANN201 - TRL's signature
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [float(len(ids)) for ids in completion_ids]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201 - verl's
    CALLS.append(
        {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
    )
    return {
        "score": float(extra_info["index"]),
        "acc": extra_info["index"] % 2 == 0,
        "pred": solution_str[:2],
    }


def verl_plain_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201
    return 0.5


def verl_no_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201
    return {"acc": 1.0}


def read(cfg: Any, folder: str, schema: pa.Schema) -> pa.Table:
    return manifests.read_complete(layout.folder(cfg.run_dir, 0, folder), schema)


def generated(make_config, data: str, reward: str) -> tuple[Any, pa.Table]:
    """Config and rollouts (2 samples per prompt) of the example prompt set `data`."""
    _, cfg = make_config(
        generate={"prompts": str(DATA / data), "num_generations": 2}, score={"reward_functions": [reward]}
    )
    run_stage("generate", cfg, 0, quiet=True)
    return cfg, read(cfg, "rollouts", ROLLOUTS)


def test_trl_conversational_prompts_and_a_trl_reward_function(make_config) -> None:
    cfg, r = generated(make_config, "trl_conversational.jsonl", f"trl:{HERE}:trl_reward")
    assert r.num_rows == 8
    # the `prompt` column holds messages: rendered with the chat template, no extra key needed
    assert r["prompt"][0].as_py() == "<|im_start|>user\nSimplify 1/3.<|im_end|>\n<|im_start|>assistant\n"
    assert r["prompt_messages"][0].as_py() == [{"role": "user", "content": "Simplify 1/3."}]
    assert r["solution"].to_pylist()[::2] == ["\\frac{1}{3}", "\\frac{1}{2}", "2", "\\frac{3}{4}"]
    CALLS.clear()
    run_stage("score", cfg, 0, quiet=True)
    (call,) = CALLS  # one batched call
    rows = r.to_pylist()
    assert call["prompts"][0] == [{"role": "user", "content": "Simplify 1/3."}]
    assert call["completions"] == [[{"role": "assistant", "content": x["response"]}] for x in rows]
    assert call["completion_ids"] == [x["response_ids"] for x in rows]
    assert call["solution"] == [x["solution"] for x in rows]
    assert "prompt_messages" not in call  # given as `prompts`
    s = read(cfg, "scores", SCORES)
    assert s["reward_trl_reward"].to_pylist() == [float(len(x["response_ids"])) for x in rows]


def test_trl_function_on_text_prompts_gets_strings(make_config) -> None:
    _, cfg = make_config(
        score={"reward_functions": [f"trl:{HERE}:trl_reward"]}, generate={"num_generations": 2}
    )
    run_stage("generate", cfg, 0, quiet=True)
    CALLS.clear()
    run_stage("score", cfg, 0, quiet=True)
    rows = read(cfg, "rollouts", ROLLOUTS).to_pylist()
    assert CALLS[0]["prompts"][:2] == [rows[0]["prompt"], rows[1]["prompt"]]
    assert CALLS[0]["completions"][:2] == [rows[0]["response"], rows[1]["response"]]
    assert {"letter", "count", "completion_ids"} <= set(CALLS[0])  # the demo prompts' columns


def test_verl_parquet_and_a_verl_compute_score(make_config) -> None:
    cfg, r = generated(make_config, "verl_math.parquet", f"verl:{HERE}:compute_score")
    assert r["prompt"][0].as_py() == "<|im_start|>user\nSimplify 1/3.<|im_end|>\n<|im_start|>assistant\n"
    # verl's columns are carried, and reward_model.ground_truth is also a column of its own
    assert {"data_source", "ability", "reward_model", "extra_info", "ground_truth"} <= set(r.column_names)
    assert r["ground_truth"].to_pylist()[::2] == ["\\frac{1}{3}", "\\frac{1}{2}", "2", "\\frac{3}{4}"]
    CALLS.clear()
    run_stage("score", cfg, 0, quiet=True)
    rows = r.to_pylist()
    assert len(CALLS) == 8  # once per rollout
    assert CALLS[2] == {
        "data_source": "example/frac",
        "solution_str": rows[2]["response"],
        "ground_truth": "\\frac{1}{2}",
        "extra_info": {"index": 1, "split": "train"},
    }
    s = read(cfg, "scores", SCORES)
    # score = extra_info.index: prompts 0..3, two samples each
    assert s["reward_compute_score"].to_pylist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    # the dict's other keys are columns: acc (bool), pred (text)
    assert s.schema.field("reward_compute_score_acc").type == pa.bool_()
    assert s["reward_compute_score_acc"].to_pylist() == [True, True, False, False, True, True, False, False]
    assert s["reward_compute_score_pred"].to_pylist() == [x["response"][:2] for x in rows]


def test_verl_float_result_and_a_dict_without_score(make_config) -> None:
    _, cfg = make_config(
        generate={"prompts": str(DATA / "verl_math.parquet"), "num_generations": 1},
        score={"reward_functions": [f"verl:{HERE}:verl_plain_score"]},
    )
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)
    assert read(cfg, "scores", SCORES)["reward_verl_plain_score"].to_pylist() == [0.5] * 4
    _, cfg = make_config(
        name="b.toml",
        generate={"prompts": str(DATA / "verl_math.parquet"), "num_generations": 1},
        score={"reward_functions": [f"verl:{HERE}:verl_no_score"]},
    )
    with pytest.raises(
        RewardError, match=r"verl_no_score returned a dict without 'score' for rollout 0000-\w+-0"
    ):
        run_stage("score", cfg, 0, quiet=True, force=True)


def test_json_array_prompt_file(make_config, tmp_path: Path) -> None:
    data = tmp_path / "p.json"
    data.write_text(json.dumps([{"id": "a", "prompt": "a*1="}, {"id": "b", "prompt": "b*2="}], indent=2))
    _, cfg = make_config(
        generate={"prompts": str(data), "num_generations": 1}, score={"reward_functions": []}
    )
    run_stage("generate", cfg, 0, quiet=True)
    r = read(cfg, "rollouts", ROLLOUTS)
    assert r["prompt_id"].to_pylist() == ["a", "b"] and r["prompt"].to_pylist() == ["a*1=", "b*2="]


REWARD_MODULE = "def my_reward(*, responses, **_):\n    return [float(len(r)) for r in responses]\n"


@pytest.mark.slow
def test_reward_module_beside_the_config_imports_in_every_mode(make_config, tmp_path: Path) -> None:
    """The console script (no cwd on sys.path), from another directory, and --in-process."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "my_rewards.py").write_text(REWARD_MODULE)
    path, cfg = make_config(
        name="conf/c.toml",
        generate={"num_generations": 1},
        score={"reward_functions": ["my_rewards:my_reward"]},
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    exe = shutil.which("rlhf-batch", path=str(Path(sys.executable).parent))
    assert exe
    env = {**os.environ, "PYTHONPATH": ""}
    for args in (["generate"], ["score"]):
        proc = subprocess.run(
            [exe, *args, str(path), "-q"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
    rows = read(cfg, "rollouts", ROLLOUTS).to_pylist()
    assert read(cfg, "scores", SCORES)["reward_my_reward"].to_pylist() == [
        float(len(x["response"])) for x in rows
    ]
    # an explicit score.reward_paths (relative to the config file) replaces the default
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "lib_rewards.py").write_text(REWARD_MODULE)
    other = conf_dir / "d.toml"
    other.write_text(path.read_text().replace("my_rewards:my_reward", "lib_rewards:my_reward"))
    sets = ["score.reward_paths=['../lib']", "generate.num_generations=4", f"run_dir={tmp_path / 'run2'}"]
    sets += ["advantage.drop_zero_variance=false"]
    cmd = [exe, "run", str(other), "--in-process", "-q", *(a for x in sets for a in ("--set", x))]
    proc = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert manifests.manifest(layout.folder(tmp_path / "run2", 0, "scores")) is not None


def test_two_verl_compute_score_functions_combine_unchanged(make_config) -> None:
    fns = [f"verl:{HERE}:compute_score", "verl:rlhf_batch.rewards.math:compute_score"]
    cfg, _ = generated(make_config, "verl_math.parquet", fns[0])
    cfg.score.reward_functions = fns
    run_stage("score", cfg, 0, quiet=True)
    s = read(cfg, "scores", SCORES)
    ours, math = (
        s["reward_test_ecosystem_compute_score"].to_pylist(),
        s["reward_math_compute_score"].to_pylist(),
    )
    assert s["reward_raw"].to_pylist() == [a + b for a, b in zip(ours, math, strict=True)]
    assert "reward_test_ecosystem_compute_score_acc" in s.column_names  # verl's extra keys follow the name
