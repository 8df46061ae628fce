"""LoRA and policy retention over whole runs: the reference is the base with the adapter disabled
(KL exactly 0 at iteration 0, one model in score), and keep_policies removes old policies without
any resume needing them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch

from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.errors import ModelError
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS, SCORES

ROOT = Path(__file__).resolve().parents[2]
LORA = {"enabled": True, "r": 4, "alpha": 8}
TRAIN = {"lr": 1e-2, "tokens_per_step": 64}


def scores(run_dir: str, it: int):
    return manifests.read_complete(layout.folder(run_dir, it, "scores"), SCORES)


def test_lora_reference_is_the_base_with_the_adapter_disabled(
    make_config, tiny_model: Path, monkeypatch
) -> None:
    from peft import PeftModel

    import rlhf_batch.stages.score.scorer as score_module

    loaded: list[str] = []
    real = score_module.load_model
    monkeypatch.setattr(score_module, "load_model", lambda p, *a, **k: loaded.append(p) or real(p, *a, **k))
    score = {"reward_functions": ["rlhf_batch.rewards.demo:letter_count"], "kl_in_reward": True}
    path, cfg = make_config(iterations=2, in_process=True, threads=1, train=TRAIN, lora=LORA, score=score)
    run_pipeline(path, [], quiet=True)

    # iteration 0 samples from the base, which is the reference: KL exactly 0, no reference forward
    s0 = scores(cfg.run_dir, 0)
    r0 = manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS)
    assert pc.all(pc.equal(pc.list_flatten(s0["kl"]), 0.0)).as_py()
    assert s0["ref_logprobs"].to_pylist() == r0["behavior_logprobs"].to_pylist()
    # iteration 1 samples from the merged policy 0; score loaded one model, the base, once
    assert loaded == [str(tiny_model)]
    s1 = scores(cfg.run_dir, 1)
    r1 = manifests.read_complete(layout.folder(cfg.run_dir, 1, "rollouts"), ROLLOUTS)
    assert set(r1["policy"].to_pylist()) == {"iter=0000/policy"}  # relative to the run directory
    kl = pc.list_flatten(s1["kl"]).to_numpy()
    assert abs(kl).max() > 1e-4  # the policy moved away from the reference
    # the reference log-probs are those of base + adapter 0 with the adapter disabled
    base = load_model(str(tiny_model), "policy", dtype="float32")
    peft = PeftModel.from_pretrained(
        base, str(layout.policy_dir(cfg.run_dir, 0) / layout.ADAPTER_DIR), local_files_only=True
    )
    seqs = [p + r for p, r in zip(r1["prompt_ids"].to_pylist(), r1["response_ids"].to_pylist(), strict=True)]
    plens = [len(p) for p in r1["prompt_ids"].to_pylist()]
    with torch.no_grad(), peft.disable_adapter():
        logp, mask, _ = response_logprobs(peft, seqs, plens, cfg.generate.temperature, pad_id=1)  # [B, T]
    expected = logp[mask].numpy()  # [N]
    got = pc.list_flatten(s1["ref_logprobs"]).to_numpy()
    assert abs(got - expected).max() < 1e-5
    with torch.no_grad():  # and with it enabled, the behaviour policy (the merged weights) up to rounding
        logp, mask, _ = response_logprobs(peft, seqs, plens, cfg.generate.temperature, pad_id=1)
    beh = pc.list_flatten(r1["behavior_logprobs"]).to_numpy()
    assert abs(logp[mask].numpy() - beh).max() < 1e-4 < abs(got - beh).max()


def _run(path: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if fault:
        env["RLHF_BATCH_FAULT"] = fault
    cmd = [sys.executable, "-m", "rlhf_batch", "run", str(path), "--in-process", "--quiet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def policies(run_dir: str, n: int) -> list[int]:
    return [it for it in range(n) if layout.policy_dir(run_dir, it).is_dir()]


def created(run_dir: str) -> dict[str, str]:
    return {str(p): p.read_text() for p in Path(run_dir).glob("iter=*/*/_manifest.json")}


@pytest.mark.slow
def test_keep_policies_removes_old_policies_and_no_resume_needs_them(
    make_config, tmp_path: Path, capsys
) -> None:
    from rlhf_batch.observe.query import run_sql
    from rlhf_batch.observe.status import print_status

    keep = {"keep_policies": 1, "keep_every": 2, "threads": 1, "train": TRAIN, "lora": LORA}
    keep["advantage"] = {"drop_zero_variance": False}  # every iteration trains (a group of equal scores too)
    path, cfg = make_config(iterations=4, name="ref.toml", run_dir=str(tmp_path / "ref"), **keep)
    done = _run(path)
    assert done.returncode == 0, done.stderr
    # last 1 (iteration 3) and every 2nd (0, 2); 1 was removed once policy 2 was complete
    assert policies(cfg.run_dir, 4) == [0, 2, 3]
    record = manifests.read_json(layout.iter_dir(cfg.run_dir, 1) / layout.POLICY_REMOVED)
    # the path below the run directory as "{run_dir}/..." (the run can be moved), read back where it is
    assert record["fingerprint"]["path"] == "{run_dir}/iter=0001/policy"
    assert not list(layout.iter_dir(cfg.run_dir, 1).glob(".policy*"))
    # running again redoes nothing: generate 2, which read policy 1, is still complete
    before = created(cfg.run_dir)
    again = _run(path)
    assert again.returncode == 0, again.stderr
    assert created(cfg.run_dir) == before
    # manifests and SQL still describe iteration 1
    capsys.readouterr()
    run_sql(cfg.run_dir, "SELECT DISTINCT iter FROM metrics ORDER BY iter", "csv")
    assert capsys.readouterr().out.split() == ["iter", "0", "1", "2", "3"]
    run_sql(cfg.run_dir, "SELECT iter FROM stages WHERE stage = 'train' ORDER BY iter", "csv")
    assert capsys.readouterr().out.split() == ["iter", "0", "1", "2", "3"]
    print_status(cfg.run_dir)
    assert capsys.readouterr().out.count("policy removed (keep_policies)") == 1
    # only a stage that must load the removed weights again fails, naming them
    with pytest.raises(ModelError, match=r"iter=0001/policy was removed by keep_policies"):
        run_stage("generate", cfg, 2, force=True, quiet=True)

    # the same run killed right after train 2's manifest (before the removal), then run again
    kpath, killed = make_config(iterations=2, name="k.toml", run_dir=str(tmp_path / "killed"), **keep)
    assert _run(kpath).returncode == 0
    dead = _run(kpath, "--iterations", "3", fault="train:manifest:done")
    assert dead.returncode == -9, dead.stderr
    assert manifests.manifest(layout.folder(killed.run_dir, 2, "train")) is not None
    assert policies(killed.run_dir, 3) == [0, 1, 2]  # not removed yet
    resumed = _run(kpath, "--iterations", "4")
    assert resumed.returncode == 0, resumed.stderr
    assert policies(killed.run_dir, 4) == [0, 2, 3]
    for it in range(4):  # the same numbers as the uninterrupted run
        assert (
            scores(killed.run_dir, it)["reward"].to_pylist() == scores(cfg.run_dir, it)["reward"].to_pylist()
        )


def test_lora_on_the_embeddings_runs_past_iteration_0(make_config) -> None:
    """embed_tokens targeted: the adapter holds the LoRA weights only (not the frozen base
    embeddings), so iteration 1 loads it back."""
    from safetensors.torch import load_file

    from rlhf_batch.commands.pipeline import run_pipeline

    lora = '[lora]\nenabled = true\ntarget_modules = ["embed_tokens", "q_proj"]\n'
    path, cfg = make_config(lora, iterations=2, in_process=True, threads=1)
    run_pipeline(path, [], quiet=True)
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "train")) is not None
    names = load_file(str(layout.policy_dir(cfg.run_dir, 1) / "adapter" / "adapter_model.safetensors"))
    assert names and all("lora_" in n for n in names), sorted(names)
    assert any("embed_tokens.lora_embedding" in n for n in names)


CONSTANT = '["tests.stages.test_train_carry:constant"]'  # no group has reward variance: nothing to train


def test_lora_iteration_0_with_nothing_to_train_then_a_fresh_adapter(make_config) -> None:
    """Iteration 0 with no trainable row carries the base forward (no adapter yet): iteration 1
    starts a fresh adapter instead of failing on the missing one."""
    from rlhf_batch.commands.pipeline import run_pipeline

    lora = f"[lora]\nenabled = true\nr = 4\nalpha = 8\n[score]\nreward_functions = {CONSTANT}\n"
    path, cfg = make_config(lora, iterations=2, in_process=True, threads=1)
    run_pipeline(path, [], quiet=True)
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "train")) is not None


def test_an_empty_iteration_under_r8_after_an_r4_adapter_is_refused(make_config) -> None:
    """Instead of copying the r = 4 adapter forward under an r = 8 config."""
    from rlhf_batch.commands.pipeline import run_pipeline
    from rlhf_batch.errors import ConfigError
    from rlhf_batch.stages.executor import execute
    from rlhf_batch.stages.registry import get

    path, cfg = make_config(
        "[lora]\nenabled = true\nr = 4\nalpha = 8\n", iterations=1, in_process=True, threads=1
    )
    run_pipeline(path, [], quiet=True)
    assert (layout.policy_dir(cfg.run_dir, 0) / "adapter").is_dir()
    r8_toml = f"[lora]\nenabled = true\nr = 8\nalpha = 16\n[score]\nreward_functions = {CONSTANT}\nkl_in_reward = false\n"
    _, r8 = make_config(r8_toml, name="r8.toml", iterations=2, threads=1)
    for name in ("generate", "score", "advantage"):
        execute(get(name)(r8, 1), quiet=True)
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "advantages"))["rows"] == 0
    with pytest.raises(
        ConfigError, match=r"lora.r: is 8, but the adapter .*iter=0000/policy/adapter has r = 4"
    ):
        run_stage("train", r8, 1, quiet=True)
    assert not layout.policy_dir(cfg.run_dir, 1).exists()
