"""Every path of a config may be a store URI: `init-model` and `init-prompts` write to the store
(never a local folder named `s3:`), prompt sets and models are read from it, and `validate`
checks them with one line per problem. A real S3-protocol server (moto's, tests/s3server.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf_batch.data.demo import write_prompts
from rlhf_batch.data.prompt_files import read_prompt_table
from rlhf_batch.store.fs import run_path
from rlhf_batch.store.modeldir import check_model_dir
from tests.stages.cli_helpers import cli, ok


@pytest.fixture
def bucket(s3_run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """s3://<fresh bucket>, the working directory an empty local folder (to see that nothing
    is written there)."""
    monkeypatch.chdir(tmp_path)
    return s3_run.rsplit("/", 1)[0]


def test_init_model_and_init_prompts_write_to_the_store(bucket: str, tmp_path: Path) -> None:
    ok("init-model", f"{bucket}/models/tiny")
    ok("init-prompts", f"{bucket}/data/prompts.jsonl", "--n", 6, "--seed", 3)
    assert os.listdir(tmp_path) == []  # nothing local: no `s3:` folder
    model = check_model_dir(f"{bucket}/models/tiny", "policy_model")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model.iterdir()}
    local = write_prompts(tmp_path / "local.jsonl", 6, seed=3)
    assert run_path(f"{bucket}/data/prompts.jsonl").read_bytes() == local.read_bytes()
    # a prompt set on the store: a file, the prefix of its shards, a glob; errors name the URI
    ok("init-prompts", f"{bucket}/data/more.jsonl", "--n", 2, "--seed", 4)
    assert read_prompt_table(f"{bucket}/data/prompts.jsonl").num_rows == 6
    assert read_prompt_table(f"{bucket}/data").num_rows == 8  # more.jsonl, prompts.jsonl
    assert read_prompt_table(f"{bucket}/data/p*.jsonl").column("id").to_pylist() == [
        json.loads(line)["id"] for line in local.read_text().splitlines()
    ]


def test_validate_checks_models_and_prompts_on_the_store(bucket: str, make_config) -> None:
    ok("init-model", f"{bucket}/m")
    ok("init-prompts", f"{bucket}/p.jsonl", "--n", 4)
    ok("init-prompts", f"{bucket}/eval/e.jsonl", "--n", 3, "--seed", 1)
    path, _ = make_config(
        run_dir=f"{bucket}/run",
        policy_model=f"{bucket}/m",
        ref_model=f"{bucket}/m",
        generate={"prompts": f"{bucket}/p.jsonl"},
        eval={"prompts": f"{bucket}/eval"},
    )
    res = cli("validate", path)
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]
    for line in (f"policy_model {bucket}/m: ok", f"ref_model {bucket}/m: ok", "(4 rows", "(3 rows"):
        assert line in res.output, res.output  # type: ignore[attr-defined]
    res = cli(
        "validate",
        path,
        "--set",
        f"policy_model={bucket}/none",
        "--set",
        f"generate.prompts={bucket}/none.jsonl",
        "--set",
        "reward_model=ftp://host/rm",
        "--set",
        f"score.reward_paths=['{bucket}/rewards']",
    )
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]  # type: ignore[attr-defined]
    assert res.exit_code == 1 and sorted(errors) == sorted(  # type: ignore[attr-defined]
        [
            f"error: policy_model: model directory not found: {bucket}/none",
            f"error: {bucket}/none.jsonl: prompt file not found",
            "error: reward_model ftp://host/rm: unknown scheme 'ftp://'; use a local path, file://, s3:// or gs://",
            f"error: {path}: 'score.reward_paths' {bucket}/rewards: reward modules are imported from local "
            "folders, not a store URI; install them as a package or give every machine a local copy",
        ]
    ), res.output  # type: ignore[attr-defined]


def test_ranks_with_the_model_on_the_store_and_a_local_copy_agree(
    bucket: str, make_config, tiny_model: Path
) -> None:
    """Rank 0 reads the base model from the store, rank 1 its local copy (the same bytes:
    init-model's defaults are the tiny_model fixture's); a run on local disk."""
    from rlhf_batch.stages.executor import is_done
    from rlhf_batch.stages.registry import get
    from tests.stages.cli_helpers import manifest

    ok("init-model", f"{bucket}/m")
    assert (
        run_path(f"{bucket}/m/model.safetensors").read_bytes()
        == (tiny_model / "model.safetensors").read_bytes()
    )
    a, cfg = make_config(name="a.toml", policy_model=f"{bucket}/m")
    b, cfg_b = make_config(name="b.toml")  # policy_model: tiny_model
    ok("generate", a, "--quiet", "--rank", 0, "--world-size", 2)
    ok("generate", b, "--quiet", "--rank", 1, "--world-size", 2)  # later: commits
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48
    assert is_done(get("generate")(cfg, 0)) and is_done(get("generate")(cfg_b, 0))


@pytest.mark.slow
def test_a_base_model_overwritten_at_its_store_address_is_refused_by_every_later_stage(
    bucket: str, make_config, tmp_path: Path
) -> None:
    """generate, score and advantage read the base model from the store; its weights are then
    overwritten at the same address (same size): a forced score (the reference) and train (the
    start policy) refuse them with one line instead of using the new weights."""
    from safetensors.torch import load_file, save_file

    from rlhf_batch.errors import ModelError
    from rlhf_batch.stages.registry import run_stage

    ok("init-model", f"{bucket}/m")
    _, cfg = make_config(policy_model=f"{bucket}/m")
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)
    run_stage("advantage", cfg, 0, quiet=True)
    local = tmp_path / "w.safetensors"
    local.write_bytes(run_path(f"{bucket}/m/model.safetensors").read_bytes())
    tensors = load_file(local)
    name = next(k for k in sorted(tensors) if tensors[k].ndim == 2)
    tensors[name] = tensors[name] * 2
    save_file(tensors, local, metadata={"format": "pt"})
    run_path(f"{bucket}/m/model.safetensors").write_bytes(local.read_bytes())
    for stage in ("score", "train"):  # score --force: the reference; train: the start policy
        with pytest.raises(ModelError, match=f"weights of {bucket}/m changed since this run read them"):
            run_stage(stage, cfg, 0, force=True, quiet=True)
