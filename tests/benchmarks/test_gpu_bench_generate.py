"""benchmarks/gpu_bench_generate.py's CPU self-test: `compare` runs every side it can and counts
the tokens each made (6 prompts x G = 2 x 6 new tokens, no row stops early)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bench_generate  # noqa: E402


def test_compare_on_a_tiny_model_counts_every_token(tmp_path: Path) -> None:
    rows = {r["name"]: r for r in gpu_bench_generate.compare(gpu_bench_generate.tiny_ctx(tmp_path))}
    assert set(rows) == {"ours (batch auto)", "transformers generate", "bare vllm", "our vllm engine"}
    for name in ("ours (batch auto)", "transformers generate"):
        assert rows[name]["tokens"] == 6 * 2 * 6, rows[name]
        assert rows[name]["tokens_per_s"] == rows[name]["tokens"] / rows[name]["seconds"] > 0
    assert rows["ours (batch auto)"]["batches"] == [12]  # "auto" on a CPU: up to 64 rows, all 12 in one
    for name in ("bare vllm", "our vllm engine"):  # this interpreter has no vLLM: the row says so
        assert "vllm is not importable" in rows[name]["skipped"]
