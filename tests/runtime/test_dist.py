"""The device of each rank: pure logic, and the one place every stage takes it from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_batch.errors import ModelError
from rlhf_batch.runtime import dist

PACKAGE = Path(__file__).parents[2] / "rlhf_batch"


def test_rank_device_puts_each_local_rank_on_its_own_gpu() -> None:
    assert dist.rank_device("cuda", 0) == "cuda:0"
    assert dist.rank_device("cuda", 1) == "cuda:1"  # not plain "cuda", which is GPU 0 for all
    assert dist.rank_device("cpu", 1) == "cpu"


def test_stage_device_on_a_cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.stage_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert dist.stage_device("auto") == "cpu"
        with pytest.raises(ModelError, match="cuda"):
            dist.stage_device("cuda")


def test_every_stage_takes_its_device_from_stage_device() -> None:
    # the bug this guards: generate passed cfg.device ("cuda") straight to load_model, so every
    # torchrun rank of a node loaded its model on GPU 0
    sources = {
        str(p.relative_to(PACKAGE)): p.read_text()
        for d in ("stages", "engines")
        for p in (PACKAGE / d).rglob("*.py")
    }
    for name in ("engines/hf.py", "stages/importer.py", "stages/score/scorer.py", "stages/train/parallel.py"):
        assert "dist.stage_device(cfg.device)" in sources[name], name
    for name, text in sources.items():
        assert text.count("cfg.device") == text.count("dist.stage_device(cfg.device)"), name
