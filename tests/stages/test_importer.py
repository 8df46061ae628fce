"""`import`: external (prompt, response) rows -> a rollouts table that score and train accept."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.errors import ConfigError, SchemaError, StageError
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.stages.importer import import_rollouts
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS, SCORES

ROWS = [
    {"prompt": "a*2=", "response": "aa", "letter": "a", "count": 2},
    {"prompt": "b*3=", "response": "bxb", "letter": "b", "count": 3},
    {"prompt": "a*2=", "response": "xa", "letter": "a", "count": 2},
    {"prompt": "c*1=", "response": "c<|endoftext|>", "letter": "c", "count": 1},  # EOS already there
    {"prompt": "c*1=", "response": "cccc", "letter": "c", "count": 1, "finish_reason": "length"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sha(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def rollouts(cfg, it: int = 0) -> list[dict]:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "rollouts"), ROLLOUTS).to_pylist()


def test_import_tokenises_appends_eos_and_carries_columns(make_config, tmp_path: Path) -> None:
    _, cfg = make_config(generate={"temperature": 0.7}, score={"rows_per_part": 2})
    m = import_rollouts(cfg, write_jsonl(tmp_path / "ext.jsonl", ROWS), 0, quiet=True)
    got = rollouts(cfg)
    tok = load_tokenizer(cfg.policy_model)
    assert [r["rollout_id"] for r in got] == [
        f"0000-{sha('a*2=')}-0",
        f"0000-{sha('b*3=')}-0",
        f"0000-{sha('a*2=')}-1",
        f"0000-{sha('c*1=')}-0",
        f"0000-{sha('c*1=')}-1",
    ]  # file order; sample_idx per prompt
    assert [r["sample_idx"] for r in got] == [0, 0, 1, 0, 1]
    chars = tok.convert_tokens_to_ids  # the char-level tokenizer: one token per character, EOS id 0
    assert got[0]["prompt_ids"] == chars(list("a*2=")) and got[0]["response_ids"] == [*chars(list("aa")), 0]
    assert got[3]["response_ids"] == [chars("c"), 0]  # not doubled
    assert got[4]["response_ids"] == chars(list("cccc")) and got[4]["finish_reason"] == "length"
    assert [r["finish_reason"] for r in got[:4]] == ["stop"] * 4
    assert {r["policy"] for r in got} == {cfg.policy_model}
    assert (got[1]["letter"], got[1]["count"], got[1]["response"]) == ("b", 3, "bxb")
    assert m["rows"] == 5 and len(m["parts"]) == 3 and m["counts"]["eos_appended"] == 3
    assert m["resolved_config"]["generate"]["temperature"] == 0.7 and m["resolved_config"] == cfg.to_dict()
    model = load_model(cfg.policy_model, "policy", dtype="float32")
    for r in got:  # the behaviour log-probs are those of one plain forward pass at temperature 0.7
        with torch.no_grad():
            lp, _, _ = response_logprobs(
                model, [r["prompt_ids"] + r["response_ids"]], [len(r["prompt_ids"])], 0.7
            )
        assert r["behavior_logprobs"] == pytest.approx(lp[0].tolist(), abs=1e-5)


def test_imported_rollouts_score_with_zero_kl_and_carried_columns(make_config, tmp_path: Path) -> None:
    _, cfg = make_config(
        score={"reward_functions": ["rlhf_batch.rewards.demo:letter_count"], "kl_in_reward": True}
    )
    import_rollouts(cfg, write_jsonl(tmp_path / "ext.jsonl", ROWS), 0, quiet=True)
    m = run_stage("score", cfg, 0, quiet=True)
    got = manifests.read_complete(layout.folder(cfg.run_dir, 0, "scores"), SCORES).to_pylist()
    # letter_count: "aa" for a*2 -> 2/2; "bxb" for b*3 -> 2/3; "xa" -> 1/2; "c<|endoftext|>" for c*1 ->
    # 1 hit / max(1, 14 characters); "cccc" for c*1 -> 1/4
    assert [r["score"] for r in got] == pytest.approx([1.0, 2 / 3, 0.5, 1 / 14, 0.25], abs=1e-12)
    assert all(r["kl_sum"] == 0.0 and r["reward"] == r["score"] for r in got)  # the policy is the reference
    assert m["rows"] == 5


def test_parquet_with_prompt_ids_and_reimport_rules(make_config, tmp_path: Path) -> None:
    _, cfg = make_config()
    path = tmp_path / "ext.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt_id": [7, 7, 8],
                "prompt": ["a*1=", "a*1=", "b*1="],
                "response": ["a", "b", "b"],
                "answer": [["x"], ["y"], ["z"]],
            }
        ),
        path,
    )
    m = import_rollouts(cfg, path, 0, quiet=True)
    got = rollouts(cfg)
    assert [r["rollout_id"] for r in got] == ["0000-7-0", "0000-7-1", "0000-8-0"]
    assert got[1]["answer"] == ["y"]  # any column type is carried along
    assert import_rollouts(cfg, path, 0, quiet=True) == m  # complete: nothing is redone
    other = write_jsonl(tmp_path / "other.jsonl", ROWS)
    with pytest.raises(StageError, match="--force"):
        import_rollouts(cfg, other, 0, quiet=True)
    assert import_rollouts(cfg, other, 0, force=True, quiet=True)["rows"] == 5


@pytest.mark.parametrize(
    ("rows", "error", "message"),
    [
        ([{"prompt": "a"}], SchemaError, "missing column 'response'"),
        (
            [{"prompt": "a", "response": "b"}, {"prompt": None, "response": "c"}],
            SchemaError,
            "column 'prompt' is null in row 2",
        ),
        ([{"prompt": 1, "response": "b"}], SchemaError, "column 'prompt' has type int64, expected string"),
        (
            [
                {"prompt_id": "q", "prompt": "a", "response": "b"},
                {"prompt_id": "q", "prompt": "c", "response": "b"},
            ],
            SchemaError,
            "prompt_id 'q' has different prompts in rows 1 and 2",
        ),
        (
            [{"prompt": "a", "response": "b", "policy": "x"}],
            SchemaError,
            "column 'policy' is computed by import",
        ),
        (
            [{"prompt": "a", "response": "b", "finish_reason": "eos"}],
            SchemaError,
            "'finish_reason' is 'eos' in row 1; expected 'stop' or 'length'",
        ),
        ([{"prompt": "", "response": "b"}], SchemaError, "the prompt has no tokens"),
    ],
)
def test_bad_files_are_refused_naming_file_column_and_row(
    make_config, tmp_path: Path, rows, error, message
) -> None:
    _, cfg = make_config()
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(error, match=message) as info:
        import_rollouts(cfg, path, 0, quiet=True)
    assert str(path) in str(info.value)


def test_an_engines_response_ids_and_logprobs_are_kept_as_given(make_config, tmp_path: Path) -> None:
    _, cfg = make_config()
    tok = load_tokenizer(cfg.policy_model)
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    rows = [  # the ids say "ab" while the text says "aa": the ids win, nothing is re-tokenised
        {"prompt": "a*2=", "response": "aa", "response_ids": [a, b], "behavior_logprobs": [-0.5, -1.25]},
        {"prompt": "b*1=", "response": "b", "response_ids": [b], "behavior_logprobs": [0.0]},
    ]
    m = import_rollouts(cfg, write_jsonl(tmp_path / "engine.jsonl", rows), 0, quiet=True)
    got = rollouts(cfg)
    assert [r["response_ids"] for r in got] == [[a, b], [b]]  # no EOS appended either
    assert [r["behavior_logprobs"] for r in got] == [[-0.5, -1.25], [0.0]]
    assert [r["response"] for r in got] == ["aa", "b"] and m["counts"]["eos_appended"] == 0


def test_given_response_ids_without_logprobs_get_the_policys(make_config, tmp_path: Path) -> None:
    _, cfg = make_config()
    tok = load_tokenizer(cfg.policy_model)
    ids = tok.convert_tokens_to_ids(["b", "a"])
    import_rollouts(
        cfg,
        write_jsonl(tmp_path / "ids.jsonl", [{"prompt": "a*2=", "response": "?", "response_ids": ids}]),
        0,
    )
    (r,) = rollouts(cfg)
    model = load_model(cfg.policy_model, "policy", dtype="float32")
    with torch.no_grad():
        lp, _, _ = response_logprobs(model, [r["prompt_ids"] + ids], [len(r["prompt_ids"])], 1.0)
    assert r["response_ids"] == ids and r["behavior_logprobs"] == pytest.approx(lp[0].tolist(), abs=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"response_ids": [1, 99999]}, r"response_ids holds 99999, outside the policy's vocabulary \[0, "),
        ({"response_ids": [-1]}, "response_ids holds -1"),
        ({"response_ids": [1, 2], "behavior_logprobs": [-1.0]}, "has 1 values for 2 response_ids"),
        (
            {"response_ids": [1], "behavior_logprobs": [0.5]},
            "holds 0.5; log-probs are finite float32 values <= 0",
        ),
        # below float32's range: it would be stored as -inf
        ({"response_ids": [1], "behavior_logprobs": [-1e300]}, "holds -1e[+]300"),
        ({"response_ids": [1, None, 2]}, "column 'response_ids' holds a null value in row 1"),
        (
            {"response_ids": [1, 2], "behavior_logprobs": [-1.0, None]},
            "'behavior_logprobs' holds a null value in row 1",
        ),
        ({"response_ids": [1], "behavior_logprobs": [float("-inf")]}, "holds -inf"),
        ({"behavior_logprobs": [-1.0]}, "'behavior_logprobs' needs the 'response_ids'"),
        (
            {"response_ids": ["a"]},
            "column 'response_ids' has type list<.*string>, expected a list of numbers",
        ),
    ],
)
def test_bad_engine_columns_are_refused(make_config, tmp_path: Path, extra: dict, message: str) -> None:
    _, cfg = make_config()
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a*2=", "response": "aa", **extra}]), path)
    with pytest.raises(SchemaError, match=message) as info:
        import_rollouts(cfg, path, 0, quiet=True)
    assert str(path) in str(info.value)


def test_wrong_suffix_missing_file_and_missing_policy(make_config, tmp_path: Path) -> None:
    _, cfg = make_config()
    (tmp_path / "rows.csv").write_text("prompt,response\n")
    with pytest.raises(ConfigError, match="expected a .jsonl or .parquet file"):
        import_rollouts(cfg, tmp_path / "rows.csv", 0)
    with pytest.raises(StageError, match="file not found"):
        import_rollouts(cfg, tmp_path / "nope.jsonl", 0)
    path = write_jsonl(tmp_path / "ext.jsonl", ROWS)
    with pytest.raises(
        StageError, match="iteration 0 has no trained policy"
    ):  # iteration 1 samples iter=0/policy
        import_rollouts(cfg, path, 1)


def test_progress_bar_counts_rows_unless_quiet(make_config, tmp_path: Path, capsys) -> None:
    _, cfg = make_config()
    path = write_jsonl(tmp_path / "ext.jsonl", ROWS)
    import_rollouts(cfg, path, 0)
    assert re.search(r"import: done 5/5 row in .*row/s\)", capsys.readouterr().err)  # stderr is no tty
    import_rollouts(cfg, path, 0, quiet=True, force=True)
    assert capsys.readouterr().err == ""


def test_cli_import(make_config, tmp_path: Path) -> None:
    cfg_path, cfg = make_config()
    path = write_jsonl(tmp_path / "ext.jsonl", ROWS)
    res = CliRunner().invoke(app, ["import", str(path), "--config", str(cfg_path), "--iter", "0", "--quiet"])
    assert res.exit_code == 0, res.output
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "rollouts"))["rows"] == 5
    other = tmp_path / "other-run"  # --run-dir wins over the config's run_dir
    args = ["import", str(path), "-c", str(cfg_path), "--run-dir", str(other), "--quiet"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert manifests.manifest(layout.folder(str(other), 0, "rollouts"))["rows"] == 5
    # untouched besides (import takes the run lock, as every command that writes a run)
    assert sorted(p.name for p in Path(cfg.run_dir).iterdir()) == [
        ".run.lock",
        "base_weights.json",
        "iter=0000",
    ]
    bare = tmp_path / "bare-run"  # no config file: the defaults plus --set
    args = ["import", str(path), "--run-dir", str(bare), "--quiet"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and "policy_model: no model directory configured" in str(res.exception)
    assert not bare.exists() or [p.name for p in bare.iterdir()] == [".run.lock"]  # nothing written
    res = CliRunner().invoke(app, [*args, "--set", f"policy_model={cfg.policy_model}"])
    assert res.exit_code == 0, res.output
    assert manifests.read_complete(layout.folder(str(bare), 0, "rollouts"), ROLLOUTS).num_rows == 5


def test_imported_rollouts_count_as_done_for_run_and_record_their_command(
    make_config, tmp_path: Path
) -> None:
    from rlhf_batch.stages.executor import is_done
    from rlhf_batch.stages.generate import Generate
    from rlhf_batch.stages.score.stage import Score

    _, cfg = make_config()
    m = import_rollouts(cfg, write_jsonl(tmp_path / "ext.jsonl", ROWS), 0, quiet=True)
    assert m["command"] == "import" and m["config"]["import"] == str((tmp_path / "ext.jsonl").resolve())
    assert is_done(Generate(cfg, 0))  # `run` keeps imported rollouts: it does not generate over them
    assert not is_done(Score(cfg, 0))
    run_stage("score", cfg, 0, quiet=True)
    assert is_done(Score(cfg, 0))
    # new rollouts (other inputs for score, same config): `run` no longer skips score, and score
    # refuses, naming the changed input
    import_rollouts(cfg, write_jsonl(tmp_path / "ext2.jsonl", ROWS[:3]), 0, force=True, quiet=True)
    assert not is_done(Score(cfg, 0))
    with pytest.raises(
        StageError, match=r"complete with a different config or inputs \(inputs.rollouts.key changed"
    ):
        run_stage("score", cfg, 0, quiet=True)


def test_a_row_longer_than_the_policys_positions_is_refused(make_config, tmp_path: Path) -> None:
    """The tiny policy holds 2048 positions; its char-level vocabulary's longest entry is
    '<|endoftext|>' (13 characters), so no text over 2048 x 2 x 13 = 53248 characters fits."""
    _, cfg = make_config()
    over = {"prompt": "a*2=", "response": "a" * 2045}  # 4 + 2045 + EOS = 2050 tokens
    path = write_jsonl(tmp_path / "long.jsonl", [over])
    with pytest.raises(
        SchemaError, match=r"rollout 0000-\w+-0: 2050 tokens, more than the policy's 2048 positions"
    ):
        import_rollouts(cfg, path, 0, quiet=True)
    chat = {"messages": [{"role": "user", "content": "a*2="}, {"role": "assistant", "content": "a" * 2100}]}
    path = write_jsonl(tmp_path / "long_chat.jsonl", [chat])
    with pytest.raises(
        SchemaError, match=r"rollout 0000-\w+-0: \d+ tokens, more than the policy's 2048 positions"
    ):
        import_rollouts(cfg, path, 0, quiet=True)
    # refused before it is tokenised (a 30 MB message would take gigabytes there)
    huge = {"messages": [{"role": "user", "content": "a*2="}, {"role": "assistant", "content": "a" * 53245}]}
    path = write_jsonl(tmp_path / "huge.jsonl", [huge])
    with pytest.raises(
        SchemaError, match=r"^\S+huge.jsonl: rollout 0000-\w+-0: 53249 characters of text, more than"
    ):
        import_rollouts(cfg, path, 0, quiet=True)
    assert not layout.list_parts(layout.folder(cfg.run_dir, 0, "rollouts"))
