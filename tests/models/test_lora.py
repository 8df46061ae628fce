"""LoRA policies ([lora], peft): what train updates, what it writes, how it reloads and resumes.

Real tiny Qwen2 models, real peft adapters, real Parquet parts (the helpers of test_train).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.models import checkpoint, lora
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.stages.executor import output_of
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train.stage import Train
from rlhf_batch.store import layout, manifests
from tests.stages.test_train import make_table, max_diff, metrics, train_toml, weights, write_advantages

LORA = "[lora]\nenabled = true\nr = 4\nalpha = 8\n"  # scale alpha / r = 2


def lora_toml(**train_keys: object) -> str:
    return train_toml(**train_keys) + LORA


def adapter_dir(run_dir: str | Path, it: int = 0) -> Path:
    return layout.policy_dir(run_dir, it) / layout.ADAPTER_DIR


def logprobs(model, seqs: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp, mask, _ = response_logprobs(model, seqs, prompt_lens, 1.0, pad_id=1)  # [B, T]
    return logp[mask]  # [N]


SEQS = [[5, 9, 12, 40, 41, 7], [6, 30, 31, 32, 8, 9, 10]]
PROMPT_LENS = [3, 2]


def test_gradients_reach_the_adapter_weights_only(make_config, tiny_model: Path) -> None:
    _, cfg = make_config(LORA)
    model = lora.wrap(cfg, load_model(str(tiny_model), "policy", dtype="float32"), None)
    logp, mask, _ = response_logprobs(model, SEQS, PROMPT_LENS, 1.0, pad_id=1)
    (-logp[mask].sum()).backward()
    named = dict(model.named_parameters())
    adapter = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    # all-linear on a 2-layer Qwen2: q k v o gate up down per layer = 14 modules, an A and a B each
    assert len(adapter) == 28
    assert {n for n, p in named.items() if p.requires_grad} == adapter
    assert all(named[n].grad is None for n in named if n not in adapter)  # the base gets no gradient
    # B starts at 0, so dL/dB = (dL/dh) x^T A^T is non-zero and dL/dA = B^T (...) is exactly 0
    assert all(named[n].grad.abs().sum() > 0 for n in adapter if ".lora_B." in n)
    assert all(named[n].grad.abs().sum() == 0 for n in adapter if ".lora_A." in n)


def test_train_writes_adapter_and_merged_weights_equal_to_base_plus_scaled_ba(
    make_config, tiny_model: Path
) -> None:
    _, cfg = make_config(lora_toml(lr=1e-2, tokens_per_step=16))
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 12, [4] * 12))
    run_stage("train", cfg, 0, quiet=True)
    ad = load_file(str(adapter_dir(cfg.run_dir) / lora.ADAPTER_WEIGHTS))
    base, merged = weights(tiny_model), weights(layout.policy_dir(cfg.run_dir, 0))
    assert merged.keys() == base.keys()
    changed = set()
    for name in (k for k in ad if ".lora_A." in k):
        # "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" -> "model.layers.0.self_attn.q_proj.weight"
        w = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        a, b = ad[name], ad[name.replace(".lora_A.", ".lora_B.")]  # A [r, in], B [out, r]
        assert a.shape[0] == b.shape[1] == 4
        expected = base[w] + (8.0 / 4) * (b @ a)  # W + (alpha / r) * B @ A, by hand
        assert (merged[w] - expected).abs().max() <= 1e-6, w
        assert (merged[w] - base[w]).abs().max() > 1e-5, w  # the adapter did learn
        changed.add(w)
    assert len(changed) == 14  # every linear layer of both decoder layers
    for w in base.keys() - changed:  # embeddings, norms (and the tied head) are the base's, bit for bit
        assert torch.equal(merged[w], base[w]), w
    first = metrics(cfg.run_dir).to_pylist()[0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # a fresh adapter is the base: B = 0


def test_adapter_reloads_to_identical_logprobs(make_config, tiny_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    _, cfg = make_config(LORA)
    model = lora.wrap(cfg, load_model(str(tiny_model), "policy", dtype="float32"), None)
    opt = torch.optim.AdamW(lora.trainable(model), lr=1e-2)
    for _ in range(3):  # move A and B away from their initial values
        logp, mask, _ = response_logprobs(model, SEQS, PROMPT_LENS, 1.0, pad_id=1)
        (-logp[mask].sum()).backward()
        opt.step()
        opt.zero_grad()
    trained = logprobs(model, SEQS, PROMPT_LENS)
    model.save_pretrained(str(tmp_path / "adapter"))

    ours = lora.wrap(cfg, load_model(str(tiny_model), "policy", dtype="float32"), tmp_path / "adapter")
    assert torch.equal(logprobs(ours, SEQS, PROMPT_LENS), trained)
    base = load_model(str(tiny_model), "policy", dtype="float32")
    theirs = PeftModel.from_pretrained(base, str(tmp_path / "adapter"), local_files_only=True)
    assert torch.equal(logprobs(theirs, SEQS, PROMPT_LENS), trained)
    with theirs.disable_adapter():  # the reference: the base itself
        plain = logprobs(load_model(str(tiny_model), "policy", dtype="float32"), SEQS, PROMPT_LENS)
        assert torch.equal(logprobs(theirs, SEQS, PROMPT_LENS), plain)
    assert (trained - plain).abs().max() > 1e-3


def test_an_iteration_continues_the_previous_adapter_on_the_base(
    make_config, tiny_model: Path, monkeypatch
) -> None:
    import rlhf_batch.models.load

    _, cfg = make_config(lora_toml(lr=1e-2, tokens_per_step=16))
    # behaviour log-probs of each iteration's start policy: iteration 1 starts from policy 0
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8), 0)
    loaded: list[str] = []
    real = rlhf_batch.models.load.load_model
    monkeypatch.setattr(
        rlhf_batch.models.load, "load_model", lambda p, *a, **k: loaded.append(p) or real(p, *a, **k)
    )
    run_stage("train", cfg, 0, quiet=True)
    write_advantages(cfg.run_dir, make_table(layout.policy_dir(cfg.run_dir, 0), [3] * 8, [4] * 8), 1)
    run_stage("train", cfg, 1, quiet=True)
    assert loaded == [str(tiny_model)] * 2  # each train loads the base once, never a merged copy
    a0, a1 = (load_file(str(adapter_dir(cfg.run_dir, it) / lora.ADAPTER_WEIGHTS)) for it in (0, 1))
    assert max_diff(a0, a1) > 1e-4
    m1 = manifests.manifest(layout.folder(cfg.run_dir, 1, "train"))
    assert m1["start_policy"] == str(layout.policy_dir(cfg.run_dir, 0))
    # base + adapter 0 is policy 0 (merged): the first ratio of iteration 1 is 1
    assert metrics(cfg.run_dir, 1).to_pylist()[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_a_run_can_start_from_an_existing_adapter(make_config, tiny_model: Path, tmp_path: Path) -> None:
    from rlhf_batch.models.policy import start_policy

    _, first = make_config(lora_toml(lr=1e-2, tokens_per_step=16), name="a.toml", run_dir=str(tmp_path / "a"))
    write_advantages(first.run_dir, make_table(tiny_model, [3] * 8, [4] * 8))
    run_stage("train", first, 0, quiet=True)
    given = adapter_dir(first.run_dir)
    extra = lora_toml(lr=1e-2, tokens_per_step=16) + f'init_adapter = "{given}"\n'
    _, cfg = make_config(extra, name="b.toml", run_dir=str(tmp_path / "b"))
    start = start_policy(cfg, 0)  # base + that adapter, merged once into RUN_DIR/init_policy
    assert Path(start) == layout.init_policy_dir(cfg.run_dir)
    assert max_diff(weights(start), weights(layout.policy_dir(first.run_dir, 0))) <= 1e-6
    assert start_policy(cfg, 0) == start  # made once
    write_advantages(cfg.run_dir, make_table(Path(start), [3] * 8, [4] * 8))
    run_stage("train", cfg, 0, quiet=True)
    # train started from the given adapter: before its first update the policy is base + that adapter
    assert metrics(cfg.run_dir).to_pylist()[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    other = tmp_path / "other_adapter"
    other.mkdir()
    (other / lora.ADAPTER_WEIGHTS).write_bytes((given / lora.ADAPTER_WEIGHTS).read_bytes()[:-8] + b"x" * 8)
    _, changed = make_config(
        lora_toml() + f'init_adapter = "{other}"\n', name="c.toml", run_dir=str(tmp_path / "b")
    )
    with pytest.raises(StageError, match="made from another adapter"):
        start_policy(changed, 0)


def test_an_adapter_of_another_rank_is_refused_naming_the_key(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    _, cfg = make_config(LORA)
    model = lora.wrap(cfg, load_model(str(tiny_model), "policy", dtype="float32"), None)
    model.save_pretrained(str(tmp_path / "r4"))
    _, r8 = make_config(LORA.replace("r = 4", "r = 8"), name="r8.toml")
    with pytest.raises(ConfigError, match=r"lora\.r: is 8, but the adapter .* has r = 4"):
        lora.wrap(r8, load_model(str(tiny_model), "policy", dtype="float32"), tmp_path / "r4")


def test_lora_config_is_checked(make_config) -> None:
    for extra, match in [
        ("[lora]\nenabled = true\nr = 0\n", r"'lora\.r' must be >= 1"),
        ("[lora]\nenabled = true\ndropout = 1.0\n", r"'lora\.dropout' must be in"),
        ("[lora]\nenabled = true\ntarget_modules = []\n", r"'lora\.target_modules' must name"),
        ('[lora]\ninit_adapter = "x"\n', r"'lora\.init_adapter' needs lora\.enabled"),
        ("[train]\nfsdp = true\n" + LORA, r"'train\.fsdp' is not supported with \[lora\]"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_config(extra)
    with pytest.raises(ConfigError, match="ref_model"):
        make_config(LORA, ref_model="/somewhere/else")
    _, cfg = make_config()
    assert not cfg.lora.enabled and cfg.lora.target_modules == ["all-linear"]


def test_a_policy_without_adapter_cannot_continue_with_lora(make_config, tiny_model: Path) -> None:
    _, full = make_config(train_toml(lr=1e-2))
    write_advantages(full.run_dir, make_table(tiny_model, [3] * 8, [4] * 8))
    run_stage("train", full, 0, quiet=True)
    _, cfg = make_config(lora_toml(lr=1e-2), name="lora.toml")
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8), 1)
    with pytest.raises(StageError, match="trained without"):
        run_stage("train", cfg, 1, quiet=True)


def test_resume_after_sigkill_with_lora_matches_an_uninterrupted_run(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    # 12 rows x 4 response tokens, 4 tokens per step: 12 steps; checkpoints after steps 4 and 8
    table = make_table(tiny_model, [3] * 12, [4] * 12)
    keys = dict(lr=1e-2, tokens_per_step=4, checkpoint_every=4)
    path, cfg = make_config(lora_toml(**keys))
    write_advantages(cfg.run_dir, table)
    fault = {"PYTHONPATH": str(Path(__file__).parents[2]), "RLHF_BATCH_FAULT": "train:checkpoint-8"}
    killed = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "train", str(path), "--iter", "0", "-q"],
        capture_output=True,
        text=True,
        env={**os.environ, **fault},
    )
    assert killed.returncode == -9, killed.stderr  # SIGKILLed at its fault point, after step 8's checkpoint
    saved = checkpoint.latest(layout.checkpoint_dir(cfg.run_dir, 0))
    assert saved is not None and saved.name == "step-00000008"
    assert not layout.policy_dir(cfg.run_dir, 0).exists()
    before = json.loads((saved / "state.json").read_text())["metrics"]

    run_stage("train", cfg, 0, quiet=True)
    rows = metrics(cfg.run_dir).to_pylist()
    assert len(rows) == 12 and rows[:8] == before  # resumed from the checkpoint, not redone
    _, ref = make_config(lora_toml(**keys), name="ref.toml", run_dir=str(tmp_path / "ref"))
    write_advantages(ref.run_dir, table)
    run_stage("train", ref, 0, quiet=True)
    losses = [r["loss"] for r in metrics(ref.run_dir).to_pylist()]
    assert [r["loss"] for r in rows] == pytest.approx(losses, abs=1e-6)
    for sub, name in (("", "model.safetensors"), (layout.ADAPTER_DIR, lora.ADAPTER_WEIGHTS)):
        a, b = (load_file(str(layout.policy_dir(run, 0) / sub / name)) for run in (cfg.run_dir, ref.run_dir))
        assert max_diff(a, b) < 1e-6


def test_gradient_checkpointing_with_lora_gives_the_same_adapter(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    table = make_table(tiny_model, [3] * 8, [4] * 8)
    adapters = {}
    for on in (False, True):
        toml = lora_toml(lr=1e-2, tokens_per_step=12, gradient_checkpointing=on)
        _, cfg = make_config(toml, name=f"gc{on}.toml", run_dir=str(tmp_path / f"gc{on}"))
        write_advantages(cfg.run_dir, table)
        run_stage("train", cfg, 0, quiet=True)
        adapters[on] = load_file(str(adapter_dir(cfg.run_dir) / lora.ADAPTER_WEIGHTS))
    fresh = lora.wrap(cfg, load_model(str(tiny_model), "policy", dtype="float32"), None)
    b_init = {n: p for n, p in fresh.state_dict().items() if ".lora_B." in n}
    assert all(float(b_init[n].abs().max()) == 0 for n in b_init)  # B starts at 0 ...
    assert (
        max(float(v.abs().max()) for k, v in adapters[True].items() if ".lora_B." in k) > 1e-4
    )  # ... and moved
    assert max_diff(adapters[True], adapters[False]) < 1e-5


def test_lora_keys_decide_train_only_when_lora_is_on(make_config, tiny_model: Path) -> None:
    _, off = make_config()
    _, on = make_config(LORA)
    # the input prepare reads
    write_advantages(on.run_dir, make_table(tiny_model, [3] * 8, [4] * 8), iteration=0)
    # without [lora] train's identity is what it was before LoRA existed: old folders stay complete
    assert "lora" not in output_of(Train(off, 0)).identity["config"]
    assert output_of(Train(on, 0)).identity["config"]["lora"] == {
        "enabled": True,
        "r": 4,
        "alpha": 8,
        "dropout": 0.0,
        "target_modules": ["all-linear"],
        "init_adapter": "",
    }
    assert "lora" not in on.identity("generate") and "lora" not in on.identity("score")
