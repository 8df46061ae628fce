"""Weights and optimizer states kept in memory by `run` with `in_process` (models/resident.py):
the run is bit for bit the one that reads every file, files that change are read again, and the
optimizer state leaves the device in one copy per dtype, optionally with bf16 moments."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf_batch.models import optim_state, resident
from rlhf_batch.models.load import load_model
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout
from tests.stages.test_train import make_table, train_toml, write_advantages


def _run_files(run: Path) -> dict[str, Any]:
    """Every Parquet table of a run (its rows, without the metrics' wall-clock rate) and every
    weight and optimizer tensor, by path."""
    out: dict[str, Any] = {}
    for f in sorted(run.rglob("*.parquet")):
        t = pq.read_table(f)
        out[str(f.relative_to(run))] = t.drop_columns([c for c in t.column_names if c == "tokens_per_s"])
    for f in sorted(run.rglob("*.safetensors")):
        out[str(f.relative_to(run))] = load_file(str(f))
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    return bool(a.equals(b))


@pytest.mark.slow
def test_an_in_process_run_keeping_models_equals_one_reading_every_file(
    make_config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Three in-process iterations with the KL in the reward (score loads the reference from
    iteration 1 on; at 0 the rollouts' policy is the reference): once as `run` does it (the
    policy, reference and AdamW state kept in memory), once with nothing kept. Same rows, same
    weights, same optimizer state; kept, no model or optimizer state is read from disk after
    iteration 0, which reads the configured model once (generate; train's start is the same
    directory, copied from memory)."""
    from rlhf_batch.commands import pipeline

    reads: dict[str, list[dict[str, int]]] = {}
    real = pipeline.run_iteration

    def counted(cfg: Any, it: int, *args: Any, **kwargs: Any) -> None:
        before = dict(resident.DISK_READS)
        real(cfg, it, *args, **kwargs)
        after = resident.DISK_READS
        reads[mode].append({k: after[k] - before.get(k, 0) for k in ("model", "optimizer")})

    monkeypatch.setattr(pipeline, "run_iteration", counted)
    score = {"reward_functions": ["rlhf_batch.rewards.demo:letter_count"], "kl_in_reward": True}
    runs = {}
    for mode in ("kept", "read"):
        reads[mode] = []
        if mode == "read":
            monkeypatch.setattr(pipeline, "_resident", lambda _: __import__("contextlib").nullcontext())
        path, cfg = make_config(
            iterations=3,
            in_process=True,
            run_dir=str(tmp_path / mode),
            name=f"{mode}.toml",
            score=score,
            train={"lr": 1e-2, "tokens_per_step": 40},
        )
        pipeline.run_pipeline(path, [], quiet=True)
        runs[mode] = _run_files(tmp_path / mode)
    assert not resident._MODELS and not resident._STATES  # dropped when the run ends
    kept, read = runs["kept"], runs["read"]
    assert kept.keys() == read.keys() and any("optimizer" in k for k in kept)
    for k in kept:
        assert _equal(kept[k], read[k]), k
    # read: generate and train, from iteration 1 on score's reference and the carried AdamW state
    assert reads["read"][:3] == [{"model": 2, "optimizer": 0}] + [{"model": 3, "optimizer": 1}] * 2
    assert reads["kept"][:3] == [{"model": 1, "optimizer": 0}] + [{"model": 0, "optimizer": 0}] * 2


def test_a_kept_model_is_read_again_once_its_files_change(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    p = tmp_path / "m"
    shutil.copytree(tiny_model, p)
    with resident.keep():
        n = resident.DISK_READS["model"]
        first = load_model(str(p), "policy", dtype="float32")
        again = load_model(str(p), "policy", dtype="float32")
        assert resident.DISK_READS["model"] == n + 1  # the second load copied the kept weights
        # each tensor at the address (mod 64) of the file's mapping: CPU kernels round by alignment
        align = [{k: t.data_ptr() % 64 for k, t in m.state_dict().items()} for m in (first, again)]
        assert align[0] == align[1] and set(align[0].values()) != {0}
        ids = torch.tensor([[5, 9, 14, 3, 7]])
        assert torch.equal(first(ids).logits, again(ids).logits)
        with torch.no_grad():
            again.model.norm.weight.add_(1.0)  # a copy: writing it leaves what is kept alone
        assert torch.equal(
            load_model(str(p), "policy", dtype="float32").model.norm.weight, first.model.norm.weight
        )
        w = load_file(str(p / "model.safetensors"))
        w["model.norm.weight"] = w["model.norm.weight"] * 2
        save_file(w, str(p / "model.safetensors"), metadata={"format": "pt"})  # another inode and mtime
        changed = load_model(str(p), "policy", dtype="float32")
        assert resident.DISK_READS["model"] == n + 2
        assert torch.equal(changed.model.norm.weight, first.model.norm.weight * 2)
    assert not resident._MODELS


def _adamw_state(device: str, params: int = 5) -> dict[str, Any]:
    """A state dict shaped as fused AdamW's: per parameter exp_avg, exp_avg_sq (float32) and a
    0-dim float32 step."""
    state = {
        i: {
            "step": torch.tensor(3.0, device=device),
            "exp_avg": torch.randn(4, 3, device=device),
            "exp_avg_sq": torch.rand(4, 3, device=device),
        }
        for i in range(params)
    }
    return {"state": state, "param_groups": [{"lr": 0.1, "params": list(range(params))}]}


@pytest.mark.parametrize("moments", [None, torch.bfloat16])
def test_the_optimizer_state_leaves_the_device_in_one_copy_per_dtype(moments: torch.dtype | None) -> None:
    """Fake CUDA tensors (no GPU needed): every dispatched op that makes a CPU tensor out of a
    CUDA one is counted. 5 parameters x 3 tensors would be 15 copies one by one; grouped: 1 for
    float32, 2 with bf16 moments (the moments, and the float32 step counts)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class DeviceToHost(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            ins = [a for a in args if isinstance(a, torch.Tensor)]
            if isinstance(out, torch.Tensor) and out.device.type == "cpu" and any(a.is_cuda for a in ins):
                self.copies += 1
            return out

    with FakeTensorMode():
        sd = _adamw_state("cuda")
        tensors = {
            f"w{i}/{k}": (v.to(moments) if moments is not None and k != "step" else v)
            for i, per in sd["state"].items()
            for k, v in per.items()
        }
        with DeviceToHost() as count:
            host = optim_state.to_host(tensors)
        assert count.copies == (1 if moments is None else 2)
        assert all(t.device.type == "cpu" for t in host.values())
        assert {k: (t.shape, t.dtype) for k, t in host.items()} == {
            k: (t.shape, t.dtype) for k, t in tensors.items()
        }
        with DeviceToHost() as count:
            for t in tensors.values():
                t.cpu()
        assert count.copies == 15  # the counter sees one copy per tensor when copied one by one


def test_the_flattened_copy_gives_each_tensor_its_own_values() -> None:
    sd = _adamw_state("cpu")
    tensors = {f"w{i}/{k}": v.to(torch.float64) for i, per in sd["state"].items() for k, v in per.items()}
    # on the CPU nothing is copied: the very tensors come back
    assert all(optim_state.to_host(tensors)[k] is t for k, t in tensors.items())


def _data_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor's data in a safetensors file, from its header (8-byte length + JSON)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def test_bf16_moments_halve_their_bytes_and_load_back_rounded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    w = torch.nn.Linear(8, 4)  # 32 + 4 parameters
    opt = torch.optim.AdamW(w.parameters(), lr=0.1)
    w(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    names = optim_state.param_names(w)
    (tmp_path / "f32").mkdir()
    (tmp_path / "bf16").mkdir()
    optim_state.save(tmp_path / "f32", opt.state_dict(), names, {})
    optim_state.save(tmp_path / "bf16", opt.state_dict(), names, {}, torch.bfloat16)
    f32, bf16 = (_data_bytes(tmp_path / d / optim_state.TENSORS) for d in ("f32", "bf16"))
    # by hand: exp_avg and exp_avg_sq of the weight 32 x 4 bytes = 128 (bf16: 64), of the bias
    # 4 x 4 = 16 (8); each step a 0-dim float32, 4 bytes either way
    assert f32 == {"weight/exp_avg": 128, "weight/exp_avg_sq": 128, "weight/step": 4,
                   "bias/exp_avg": 16, "bias/exp_avg_sq": 16, "bias/step": 4}  # fmt: skip
    assert bf16 == {"weight/exp_avg": 64, "weight/exp_avg_sq": 64, "weight/step": 4,
                    "bias/exp_avg": 8, "bias/exp_avg_sq": 8, "bias/step": 4}  # fmt: skip
    fresh = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    optim_state.restore(tmp_path / "bf16", fresh, fresh_opt, sharded=False)
    got, want = fresh_opt.state_dict()["state"][0], opt.state_dict()["state"][0]
    assert got["exp_avg"].dtype == torch.float32  # back in the parameter's dtype, rounded
    assert torch.equal(got["exp_avg"], want["exp_avg"].to(torch.bfloat16).float())
    assert not torch.equal(got["exp_avg"], want["exp_avg"])  # the check can fail: rounding shows
    assert float(got["step"]) == 1.0


def test_bf16_moments_carried_through_memory_or_through_the_files_train_alike(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    """train.optimizer_state_dtype = bfloat16 over two iterations: iteration 1 resumes from the
    state kept in memory or read from the file, with the same weights bit for bit."""
    policies = {}
    for mode in ("kept", "read"):
        keys = dict(lr=1e-2, tokens_per_step=8, max_tokens_per_batch=64, optimizer_state_dtype="bfloat16")
        _, cfg = make_config(
            train_toml(**keys), iterations=2, run_dir=str(tmp_path / mode), name=f"{mode}.toml"
        )
        for it in (0, 1):
            write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8, seed=it), iteration=it)
        n = resident.DISK_READS["optimizer"]
        with resident.keep() if mode == "kept" else __import__("contextlib").nullcontext():
            for it in (0, 1):
                run_stage("train", cfg, it, quiet=True)
        assert resident.DISK_READS["optimizer"] == n + (mode != "kept")
        policies[mode] = load_file(str(layout.policy_dir(cfg.run_dir, 1) / "model.safetensors"))
        meta = optim_state.read_meta(layout.optimizer_dir(cfg.run_dir, 0))
        assert meta["moments_dtype"] == "bfloat16"
    assert _equal(policies["kept"], policies["read"])


def test_init_model_dtype_saves_that_dtype_and_train_keeps_it(make_config, tmp_path: Path) -> None:
    from rlhf_batch.models.tiny import init_model

    f32 = load_file(str(init_model(tmp_path / "f32", seed=3) / "model.safetensors"))
    p = init_model(tmp_path / "bf16", seed=3, dtype="bfloat16")
    bf16 = load_file(str(p / "model.safetensors"))
    assert json.loads((p / "config.json").read_text())["dtype"] == "bfloat16"
    assert bf16.keys() == f32.keys() and all(bf16[k].dtype == torch.bfloat16 for k in bf16)
    assert all(torch.equal(bf16[k], f32[k].to(torch.bfloat16)) for k in bf16)  # the float32 draw, rounded
    with pytest.raises(ValueError, match="dtype must be one of"):
        init_model(tmp_path / "x", dtype="int8")
    _, cfg = make_config(train_toml(lr=1e-2, tokens_per_step=8, max_tokens_per_batch=64), policy_model=str(p))
    write_advantages(cfg.run_dir, make_table(p, [3] * 8, [4] * 8), iteration=0)
    run_stage("train", cfg, 0, quiet=True)
    out = layout.policy_dir(cfg.run_dir, 0)
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
