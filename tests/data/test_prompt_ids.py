"""Prompt ids as TRL and verl users have them: repeated prompts, nested id columns, bad ids."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_batch.data.prompts import load_prompts
from rlhf_batch.errors import StageError
from rlhf_batch.models.load import load_tokenizer
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.ids import prompt_hash
from rlhf_batch.store.schemas import ROLLOUTS


def rollouts(cfg, it: int = 0) -> pa.Table:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "rollouts"), ROLLOUTS)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_repeated_prompts_are_each_their_own_prompt_in_every_batch(make_config, tmp_path: Path) -> None:
    # rows 0, 2 and 3 hold the same text: ids hash, hash-1, hash-2 (file order), row 1 its own hash
    data = write_jsonl(tmp_path / "rep.jsonl", [{"prompt": t} for t in ("a*2=", "b*1=", "a*2=", "a*2=")])
    h, b = prompt_hash("a*2="), prompt_hash("b*1=")
    expected = {0: h, 1: b, 2: f"{h}-1", 3: f"{h}-2"}
    _, cfg = make_config(generate={"prompts": str(data), "prompts_per_iteration": 2, "num_generations": 2})
    tok = load_tokenizer(cfg.policy_model)
    seen = {}
    for batch in range(4):  # two epochs of two batches of 2 prompts: every file row twice
        p = load_prompts(cfg.generate, tok, batch, cfg.seed)
        for row, pid in zip(p.batch["rows"], p.ids, strict=True):
            assert seen.setdefault(row, pid) == pid  # the same id in every batch and epoch
    assert seen == expected
    m = run_stage("generate", cfg, 0, quiet=True)  # and the stage writes them
    ids = rollouts(cfg).column("prompt_id").to_pylist()[::2]
    assert ids == [expected[r] for r in m["prompt_batch"]["rows"]]


def test_a_nested_id_column_names_a_struct_field(make_config, tmp_path: Path) -> None:
    table = pa.table(
        {
            "prompt": ["a*2=", "a*2="],
            "extra_info": [{"index": 7, "split": "train"}, {"index": 9, "split": "train"}],
        }
    )
    pq.write_table(table, tmp_path / "verl.parquet")
    _, cfg = make_config(
        generate={"prompts": str(tmp_path / "verl.parquet"), "id_column": "extra_info.index"}
    )
    run_stage("generate", cfg, 0, quiet=True)
    t = rollouts(cfg)
    assert t.column("prompt_id").to_pylist() == ["7"] * 4 + ["9"] * 4
    assert t.column("extra_info").to_pylist()[0] == {"index": 7, "split": "train"}  # still carried


@pytest.mark.parametrize(
    ("rows", "id_column", "needle"),
    [
        (
            [{"prompt": "x", "uid": 1}],
            "uuid",
            "generate.id_column 'uuid' is not a column (columns: prompt, uid)",
        ),
        ([{"prompt": "x"}], "extra_info.index", "generate.id_column 'extra_info.index' is not a column"),
        (
            [{"prompt": "x", "uid": "a"}, {"prompt": "y", "uid": "b"}, {"prompt": "z", "uid": "a"}],
            "uid",
            "rows 0 and 2 have the same id 'a' in id column 'uid'",
        ),
        (
            [{"prompt": "x", "uid": "a"}, {"prompt": "y", "uid": None}],
            "uid",
            "row 1: id column 'uid' is null",
        ),
    ],
)
def test_a_missing_or_repeating_id_column_is_an_error_naming_file_rows(
    make_config, tmp_path: Path, rows: list[dict], id_column: str, needle: str
) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    _, cfg = make_config(generate={"prompts": str(data), "id_column": id_column})
    with pytest.raises(StageError, match="bad.jsonl") as e:
        run_stage("generate", cfg, 0, quiet=True)
    assert needle in str(e.value)
    assert "--force" not in str(e.value)


def test_repeated_ids_are_found_in_the_whole_file_not_only_the_batch(make_config, tmp_path: Path) -> None:
    # rows 1 and 3 repeat an id; batch 0 of 2 prompts may hold neither, the error still names them
    rows = [{"prompt": f"{c}*1=", "uid": u} for c, u in zip("abcd", ["p", "q", "r", "q"], strict=True)]
    data = write_jsonl(tmp_path / "ids.jsonl", rows)
    _, cfg = make_config(generate={"prompts": str(data), "id_column": "uid", "prompts_per_iteration": 2})
    with pytest.raises(StageError, match="rows 1 and 3 have the same id 'q'"):
        run_stage("generate", cfg, 0, quiet=True)


def test_errors_in_a_batch_name_the_file_row(make_config, tmp_path: Path) -> None:
    # row 0 is at position 1 of batch 0 (seed 0's order is rows 2, 0, 1, 3)
    rows = [{"prompt": ""}, {"prompt": "b*1="}, {"prompt": "c*1="}, {"prompt": "d*1="}]
    data = write_jsonl(tmp_path / "e.jsonl", rows)
    _, cfg = make_config(generate={"prompts": str(data), "prompts_per_iteration": 4})
    with pytest.raises(StageError, match=r"e.jsonl: row 0: column 'prompt' is null or empty"):
        run_stage("generate", cfg, 0, quiet=True)
