"""init-model --shape: the named shapes, the Qwen2.5-0.5B one checked against its published size."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.models.tiny import SHAPES, build_tokenizer, model_config

runner = CliRunner()


def test_qwen25_05b_shape_has_its_parameter_count() -> None:
    """Qwen2.5-0.5B has 494,032,768 parameters (tied embeddings), worked out by hand:
    embedding 151936 x 896 = 136,134,656; per layer q 896x896 + 896 = 803,712, k and v
    896x128 + 128 = 114,816 each, o 896x896 = 802,816, MLP 3 x 896 x 4864 = 13,074,432, two norms
    1,792: 14,912,384 x 24 layers = 357,897,216; final norm 896. Sum 494,032,768."""
    s = SHAPES["qwen2.5-0.5b"]
    tok = build_tokenizer(vocab_size=s["vocab_size"])
    cfg = model_config(tok, "qwen2", s["hidden"], s["layers"], s["heads"], s["kv_heads"], s["intermediate"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert len(tok) == 151936
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


def test_cli_shape_sets_the_sizes_and_a_bad_name_is_one_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["init-model", str(tmp_path / "m"), "--shape", "tiny", "--hidden", "128"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 2, 128)
    r = runner.invoke(app, ["init-model", str(tmp_path / "x"), "--shape", "qwen-7b"])
    assert r.exit_code != 0 and "--shape: must be one of tiny, qwen2.5-0.5b, got 'qwen-7b'" in str(
        r.exception
    )
    assert not (tmp_path / "x").exists()


def test_model_files_are_as_readable_as_the_umask_says(tmp_path: Path) -> None:
    """safetensors creates its files 0600; a model written for pods of another uid (or group) must
    get the umask's permissions: 0o666 & ~umask for files, 0o777 & ~umask for folders."""
    import os
    import stat

    from rlhf_batch.models.tiny import init_model

    for mask, file_mode, dir_mode in [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)]:
        old = os.umask(mask)
        try:
            out = init_model(tmp_path / f"m{mask:o}", arch="qwen2", seed=0)
        finally:
            os.umask(old)
        assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == file_mode
        assert stat.S_IMODE((out / "config.json").stat().st_mode) == file_mode
        assert stat.S_IMODE(out.stat().st_mode) == dir_mode
