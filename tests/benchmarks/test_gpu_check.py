"""benchmarks/gpu_check.py on the CPU (`--device cpu --shape tiny`): every stage of one iteration in
bf16 through the same commands the GPU run uses (FSDP2 on one rank under torchrun included), its
report, and its loud failures; and the wheel list `make wheels` downloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import make_target

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
MODEL_STAGES = ("generate", "score", "train", "train_fsdp", "eval")


def gpu_check(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--no-install", "--out", str(out), *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=900, cwd=ROOT)


@pytest.mark.slow
def test_every_stage_runs_in_bf16_on_cpu_and_matches_float32(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    from gpu_numerics import TOL

    # `make gpu-check` as written (its relative --out gpu_check) with --tiny: no path of the GPU run can fail
    done = make_target(tmp_path, "gpu-check", "GPU_ARGS=--tiny")
    assert done.returncode == 0, done.stderr[-4000:]
    tmp_path = tmp_path / "gpu_check"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["errors"] == []
    stages = report["stages"]
    assert list(stages) == ["generate", "score", "advantage", "train", "train_fsdp", "eval"]
    assert all(s["tokens"] > 0 and s["tokens_per_s"] > 0 for s in stages.values())
    assert all(stages[s]["bf16_utilisation"] > 0 for s in MODEL_STAGES) and report["peak_tflops"] > 0
    assert (stages["train"]["fsdp"], stages["train_fsdp"]["fsdp"]) == (False, True)
    # one rank with FSDP2 trains as plain training does: the same rows, the same loss
    assert stages["train_fsdp"]["loss"] == pytest.approx(stages["train"]["loss"], abs=1e-4)
    n = report["numerics"]
    assert n["rows"] == 4 and n["tokens"] > 0
    for name in ("score_bf16", "train_autocast"):
        assert 0 < n[f"{name}_logprob_mean_abs"] <= n[f"{name}_logprob_max_abs"] <= TOL["logprob_max"]
    assert abs(n["loss_device"] - n["loss_cpu_fp32"]) <= TOL["loss_abs"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.rstrip().endswith("result: ok") and "| train_fsdp |" in md and "bf16 matmul peak" in md
    # the reference is another random model: score ran its forward and the KL is not zero
    kl = json.loads((tmp_path / "work/run/iter=0000/scores/_manifest.json").read_text())["mean_kl_sum"]
    assert abs(kl) > 1e-3


def test_no_cuda_device_fails_loudly(tmp_path: Path) -> None:
    done = gpu_check(tmp_path, "--device", "cuda", "--shape", "tiny")
    assert done.returncode == 1
    assert "sees no CUDA device" in done.stderr and "result: FAILED" in done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["stages"] == {} and "sees no CUDA device" in report["errors"][0]


@pytest.mark.slow
def test_a_stage_that_dies_fails_the_check_naming_it(tmp_path: Path) -> None:
    done = gpu_check(tmp_path, "--device", "cpu", "--shape", "tiny", RLHF_BATCH_FAULT="scores:model-loaded")
    assert done.returncode == 1
    assert "score failed (exit -9)" in done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["stages"]) == ["generate"]  # nothing after the failed stage ran


def test_wheels_are_the_runtime_closure_without_torch() -> None:
    sys.path.insert(0, str(BENCH))
    from gpu_wheels import closure

    pins = closure()
    assert {"duckdb", "datasets", "tensordict", "typer", "math-verify", "transformers", "pyarrow"} <= set(
        pins
    )
    assert not {"torch", "triton", "pytest", "ruff", "mypy", "wandb"} & set(pins)
    assert not [p for p in pins if p.startswith("nvidia")]
    from packaging.utils import canonicalize_name

    lines = [line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line]
    pinned = {canonicalize_name(name): version for name, version in lines}
    assert {name: v for name, v in pins.items() if pinned.get(name, v) != v} == {}  # constraints.txt's pins
    assert pins["python-dateutil"] == pinned["python-dateutil"]  # the pin, whatever is installed here


def test_wheels_leave_out_what_the_gpu_machine_has(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    from gpu_wheels import closure, read_have

    have = tmp_path / "freeze.txt"
    # a bare name (any version), a version every requirement accepts, a version datasets refuses
    have.write_text("transformers\nnumpy==2.4.6  # pinned\npyarrow==17.0.0\n\n")
    assert read_have(have) == {"transformers": None, "numpy": "2.4.6", "pyarrow": "17.0.0"}
    full, pins = closure(), closure(have=read_have(have))
    assert "transformers" not in pins and "numpy" not in pins
    # tokenizers is needed only by transformers, which the machine has with its own requirements
    assert "tokenizers" in full and "tokenizers" not in pins
    # the installed datasets asks for a newer pyarrow than 17: ours comes along
    assert pins["pyarrow"] == full["pyarrow"]
    assert {"duckdb", "datasets", "tensordict", "math-verify"} <= set(pins)
