"""What a stage's identity holds: the thread count (it changes float rounding), no absolute path
of the run directory (a run directory can be moved or copied and go on)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, [*args, "--quiet"])
    return res.exit_code, res.output + str(res.exception or "")


def _manifests(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): p.read_text() for p in sorted(run_dir.rglob("_manifest.json"))}


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """The commands set torch's thread count in this process: later tests compare in-process
    runs with subprocess ones, so the count is put back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_threads_are_resolved_recorded_and_compared(make_config) -> None:
    path, cfg = make_config(threads=0)
    assert _cli("generate", str(path))[0] == 0
    m = json.loads((Path(cfg.run_dir) / "iter=0000" / "rollouts" / "_manifest.json").read_text())
    assert m["config"]["threads"] == len(os.sched_getaffinity(0))  # 0: one per usable CPU
    code, out = _cli("generate", str(path), "--set", "threads=7")
    assert code == 1
    assert f"config.threads: {len(os.sched_getaffinity(0))} on disk, 7 now" in out


def test_a_copied_run_directory_goes_on_without_redoing_anything(make_config, tmp_path: Path) -> None:
    """Iteration 0 in runs/a; `cp -a runs/a runs/b`; `run` on b with 2 iterations does iteration
    1 only (iteration 0's manifests stay byte for byte), starting from b's own iteration-0 policy."""
    from rlhf_batch.commands.pipeline import run_pipeline

    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    path, _ = make_config(run_dir=str(a), in_process=True, threads=1)
    run_pipeline(path, [], quiet=True)
    shutil.copytree(a, b, symlinks=True)
    before = _manifests(b)
    assert len(before) == 4
    shutil.rmtree(a)  # nothing of b may still point into a
    run_pipeline(path, [f"run_dir={b}", "iterations=2"], quiet=True)
    after = _manifests(b)
    assert {k: after[k] for k in before} == before
    assert sorted(set(after) - set(before)) == [
        f"iter=0001/{f}/_manifest.json" for f in ("advantages", "rollouts", "scores", "train")
    ]
    rollouts = json.loads(after["iter=0001/rollouts/_manifest.json"])
    assert rollouts["inputs"]["policy"]["path"] == "{run_dir}/iter=0000/policy"


@pytest.mark.slow
def test_base_weights_replaced_with_the_same_size_and_mtime_are_refused(
    make_config, tiny_model, tmp_path
) -> None:
    """The initial policy's weights rewritten in place with other values, then given back their
    size and mtime (as `cp -p` or `touch -d` would): the next stage hashes them again and refuses."""
    from safetensors.torch import load_file, save_file

    from rlhf_batch.errors import ModelError
    from rlhf_batch.stages.registry import run_stage

    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    _, cfg = make_config(policy_model=str(base))
    run_stage("generate", cfg, 0, quiet=True)  # records the base weights' sha256
    weights = base / "model.safetensors"
    st = weights.stat()
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if tensors[k].ndim == 2)
    tensors[name] = tensors[name] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(ModelError, match=f"weights of {base} changed since this run read them"):
        run_stage("score", cfg, 0, quiet=True)
