"""Prompt sets as TRL and verl users have them: lists of files, globs, shard dirs, hub datasets."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_batch.config import load_config
from rlhf_batch.data.prompts import read_table
from rlhf_batch.errors import StageError
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS

ROWS = [{"id": f"p{i}", "prompt": f"{'abcdef'[i]}*1=", "answer": "abcdef"[i]} for i in range(6)]


def shards(folder: Path) -> Path:
    """ROWS in three shards: two Parquet, one JSONL (names sort in row order)."""
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), folder / "train-00000.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[2:4]), folder / "train-00001.parquet")
    (folder / "train-00002.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[4:]))
    return folder


def test_a_list_a_glob_and_a_shard_directory_read_the_same_rows(tmp_path: Path) -> None:
    d = shards(tmp_path / "data")
    files = [str(d / "train-00000.parquet"), str(d / "train-00001.parquet"), str(d / "train-00002.jsonl")]
    for spec in (files, str(d / "train-*"), str(d)):
        assert read_table(spec).to_pylist() == ROWS, spec


def test_bad_sources_are_errors_naming_them(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(StageError, match="empty: a directory without .parquet, .jsonl or .json files"):
        read_table(str(tmp_path / "empty"))
    with pytest.raises(StageError, match=r"nothing-\*.parquet: the pattern matches no prompt file"):
        read_table(str(tmp_path / "nothing-*.parquet"))
    pq.write_table(pa.table({"prompt": [1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(StageError, match="b.parquet: its columns do not match those of .*a.parquet"):
        read_table([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])


def hub_cache_with_dataset(cache: Path, repo: str, folder: Path) -> None:
    """A dataset as huggingface_hub lays it out in its cache (no download): refs/main -> a
    snapshot holding data/<split>-*.parquet."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"datasets--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit / "data"
    snap.mkdir(parents=True)
    for p in sorted(folder.iterdir()):
        (snap / p.name).write_bytes(p.read_bytes())
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), snap / "test-00000.parquet")


def test_a_hub_dataset_id_reads_its_split_from_the_local_cache(
    tmp_path: Path, monkeypatch, make_config
) -> None:
    cache = tmp_path / "hf"
    hub_cache_with_dataset(cache, "someorg/prompts", shards(tmp_path / "src"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert read_table("someorg/prompts").to_pylist() == ROWS  # split train by default
    assert read_table("someorg/prompts:test").to_pylist() == ROWS[:1]
    path, _ = make_config(generate={"prompts": "someorg/prompts", "num_generations": 1})
    cfg = load_config(path)
    assert cfg.generate.prompts == "someorg/prompts"  # kept as an id, not made a path
    run_stage("generate", cfg, 0, quiet=True)
    t = manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS)
    assert t["prompt_id"].to_pylist() == [r["id"] for r in ROWS]
    with pytest.raises(
        StageError,
        match=r"someorg/other: not a local path and not a dataset in the Hugging Face cache .*`hf download someorg/other --repo-type dataset`",
    ):
        read_table("someorg/other")


def test_a_list_in_the_config_resolves_each_path_against_the_config_dir(tmp_path: Path, make_config) -> None:
    shards(tmp_path / "data")
    path, _ = make_config(generate={"prompts": ["data/train-00000.parquet", "data/train-0000[12].*"]})
    cfg = load_config(path)
    assert cfg.generate.prompts == [
        str(tmp_path / "data/train-00000.parquet"),
        str(tmp_path / "data/train-0000[12].*"),
    ]
    assert read_table(cfg.generate.prompts).to_pylist() == ROWS
    assert os.path.isabs(cfg.generate.prompts[1])
