"""benchmarks/gpu_bench.py on the CPU (`--tiny`): the whole path of the GPU benchmark (init-model,
the generate stage, score and train in steady state beside their TRL-style anchors, the fixed
costs), its report and its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks import make_target


@pytest.mark.slow
def test_the_gpu_benchmark_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    # `make gpu-bench` as written (its relative --out gpu_bench) with --tiny: no path of the GPU run can fail
    done = make_target(tmp_path, "gpu-bench", "GPU_ARGS=--tiny", timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    tmp_path = tmp_path / "gpu_bench"
    r = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert (r["device"], r["shape"], r["sizes"]["new"]) == ("cpu", "tiny", 8)
    fixed = (
        "imports_s",
        "score_model_load_s",
        "train_model_load_s",
        "optimizer_save_s",
        "optimizer_load_s",
        "policy_save_s",
    )
    assert all(r["fixed"][k] > 0 for k in fixed), r["fixed"]
    for stage in ("score", "train"):
        s = r["stages"][stage]
        for side in ("ours", "anchor"):  # steady state: at least one timed batch past the first
            assert s[side]["batches"] >= 1 and s[side]["tokens"] > 0 and s[side]["tokens_per_s"] > 0
            assert s[side]["mfu"] > 0
        assert s["ratio"] == pytest.approx(s["ours"]["tokens_per_s"] / s["anchor"]["tokens_per_s"])
    assert r["generate"]["tokens_per_s"] > 0 and 0 <= r["responses_at_limit"] <= 1
    assert (tmp_path / "work" / "policy-out" / "config.json").exists()  # the policy save it timed
    table = (tmp_path / "gpu_bench.md").read_text()
    assert "| train (steady state) |" in table and "fixed costs: imports_s" in table
