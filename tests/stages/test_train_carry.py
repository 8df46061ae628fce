"""One optimizer for the run: two train iterations run as separate processes (the second one
killed after a checkpoint and resumed) give the weights of one plain AdamW loop that never
dropped its state, and not those of a loop that resets it between iterations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from rlhf_batch.core.losses import grpo_loss
from rlhf_batch.errors import StageError
from rlhf_batch.models import checkpoint, optim_state
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from tests.stages.test_train import make_table, max_diff, metrics, train_toml, weights, write_advantages

# 8 rows of 3 prompt + 4 response tokens, 8 tokens per step: 4 steps of 2 rows, in file order
STEPS = ([0, 1], [2, 3], [4, 5], [6, 7])
KEYS = dict(
    lr=1e-2,
    warmup_steps=3,
    lr_schedule="linear",
    tokens_per_step=8,
    max_tokens_per_batch=64,
    checkpoint_every=2,
)
# the run's schedule: total = iterations (2) x 4 steps = 8; warmup (s + 1) / 3 for s < 3, then
# 1 - (s - 3) / 5: factors 1/3, 2/3, 1, 1 | 0.8, 0.6, 0.4, 0.2 (warmup once, decay over the run)
FACTORS = (1 / 3, 2 / 3, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2)


def plain_adamw(model_dir: Path, tables: list[pa.Table], *, reset_between_iterations: bool) -> dict[str, Any]:
    """The reference: one plain torch AdamW loop over the same steps (one micro-batch each), lr
    set by hand from FACTORS at the run's global step. `reset_between_iterations`: a new AdamW
    (fresh moments and step count) for the second iteration, the schedule going on."""
    model = load_model(str(model_dir), "policy", dtype="float32")
    model.train()
    pad = load_tokenizer(str(model_dir)).pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)  # as train's
    g = 0
    for it, table in enumerate(tables):
        if it and reset_between_iterations:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
        t = table.to_pydict()
        for rows in STEPS:
            seqs = [t["input_ids"][i] for i in rows]
            logp, mask, _ = response_logprobs(model, seqs, [3, 3], 1.0, pad_id=pad)  # [2, 4]
            old = torch.tensor([t["behavior_logprobs"][i] for i in rows])  # [2, 4]
            ref = torch.tensor([t["ref_logprobs"][i] for i in rows])  # [2, 4]
            adv = torch.tensor([t["advantage"][i] for i in rows], dtype=torch.float32)  # [2]
            out = grpo_loss(
                logp, old, adv, mask, ref_logprobs=ref, eps_low=0.2, eps_high=0.2, denominator=8.0
            )
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in opt.param_groups:
                group["lr"] = 1e-2 * FACTORS[g]
            opt.step()
            g += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_train(config: Path, iteration: int, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    env.pop("RLHF_BATCH_FAULT", None)
    if fault:
        env["RLHF_BATCH_FAULT"] = fault
    cmd = [sys.executable, "-m", "rlhf_batch", "train", str(config), "--iter", str(iteration), "-q"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_iterations_in_separate_processes_equal_one_optimizer_that_never_stopped(
    make_config, tiny_model: Path
) -> None:
    path, cfg = make_config(train_toml(**KEYS), iterations=2)
    tables = [make_table(tiny_model, [3] * 8, [4] * 8, seed=s) for s in (0, 1)]
    for it, table in enumerate(tables):
        write_advantages(cfg.run_dir, table, iteration=it)

    assert run_train(path, 0).returncode == 0
    # iteration 1 is killed after its checkpoint of step 2, then resumed by a third process
    killed = run_train(path, 1, fault="train:checkpoint-2")
    assert killed.returncode == -9, killed.stderr
    ckpt = checkpoint.latest(layout.checkpoint_dir(cfg.run_dir, 1))
    assert ckpt is not None and ckpt.name == "step-00000002"
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "train")) is None
    done = run_train(path, 1)
    assert done.returncode == 0, done.stderr

    lrs = metrics(cfg.run_dir, 0).column("lr").to_pylist() + metrics(cfg.run_dir, 1).column("lr").to_pylist()
    assert lrs == pytest.approx([1e-2 * f for f in FACTORS], rel=1e-12)
    m1 = manifests.manifest(layout.folder(cfg.run_dir, 1, "train"))
    assert m1["optimizer"] == {
        "global_step_start": 4,
        "global_step": 8,
        "total_steps": 8,
        "carried_from": 0,
        "changed": {},
    }
    # AdamW's own step count (its bias correction) ran on over both iterations: 8 steps
    state = load_file(str(layout.optimizer_dir(cfg.run_dir, 1) / optim_state.TENSORS))
    assert float(state["model.embed_tokens.weight/step"]) == 8.0

    staged = weights(layout.policy_dir(cfg.run_dir, 1))
    one_loop = plain_adamw(tiny_model, tables, reset_between_iterations=False)
    reset = plain_adamw(tiny_model, tables, reset_between_iterations=True)
    assert staged.keys() <= one_loop.keys()
    one_loop = {k: one_loop[k] for k in staged}
    reset = {k: reset[k] for k in staged}
    assert max_diff(staged, one_loop) < 1e-6
    # the check can fail: resetting the moments between iterations moves the weights 100x further
    assert max_diff(staged, reset) > 100 * max(max_diff(staged, one_loop), 1e-6)


def test_no_optimizer_state_is_pickled(tmp_path: Path) -> None:
    # AdamW after 1 step: exp_avg = (1 - 0.9) g = 0.1 g, exp_avg_sq = 0.001 g^2, step 1.
    # For loss = sum(w), g = 1 per weight: exp_avg 0.1, exp_avg_sq 0.001.
    w = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.AdamW(w.parameters(), lr=0.1)
    w.weight.sum().backward()
    opt.step()
    optim_state.save(tmp_path, opt.state_dict(), optim_state.param_names(w), {"global_step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.json", "optimizer.safetensors"]
    tensors = load_file(str(tmp_path / "optimizer.safetensors"))
    assert torch.allclose(tensors["weight/exp_avg"], torch.full((1, 2), 0.1))
    assert torch.allclose(tensors["weight/exp_avg_sq"], torch.full((1, 2), 0.001))
    assert float(tensors["weight/step"]) == 1.0
    fresh = torch.nn.Linear(2, 1, bias=False)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    optim_state.restore(tmp_path, fresh, fresh_opt, sharded=False)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert optim_state.read_meta(tmp_path)["global_step"] == 1
    other = torch.nn.Linear(2, 1)  # has a bias the state does not know, and the state a weight
    bad = tmp_path / "bad"
    bad.mkdir()
    optim_state.save(bad, {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w0"]}]}, [], {})
    with pytest.raises(StageError, match="another model"):
        optim_state.restore(bad, other, torch.optim.AdamW(other.parameters()), sharded=False)


def test_schedule_change_mid_run_is_refused_unless_force(make_config, tiny_model: Path) -> None:
    _, cfg = make_config(train_toml(**KEYS), iterations=2)
    for it in (0, 1):
        write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8, seed=it), iteration=it)
    run_stage("train", cfg, 0, quiet=True)
    _, cosine = make_config(train_toml(**{**KEYS, "lr_schedule": "cosine"}), name="c.toml", iterations=2)
    with pytest.raises(
        StageError, match=r"train.lr_schedule 'linear' -> 'cosine' since iteration 0.*--force"
    ):
        run_stage("train", cosine, 1, quiet=True)
    assert not layout.folder(cfg.run_dir, 1, "train").exists()  # refused before anything was written
    m = run_stage("train", cosine, 1, force=True, quiet=True)
    assert m["optimizer"]["changed"] == {"lr_schedule": ["linear", "cosine"]}
    # the new schedule at the run's steps 4..7 of 8: 0.5 (1 + cos(pi (s - 3) / 5)), s = 4: 0.904508
    assert metrics(cfg.run_dir, 1).column("lr").to_pylist()[0] == pytest.approx(1e-2 * 0.904508, rel=1e-5)


def constant(*, responses: list[str], **_: Any) -> list[float]:
    """A reward that tells no response apart: every group has zero variance."""
    return [0.5] * len(responses)


def test_run_goes_on_through_iterations_with_no_trainable_row(make_config, tiny_model: Path, capfd) -> None:
    from rlhf_batch.commands.pipeline import run_pipeline

    score = {"reward_functions": ["tests.stages.test_train_carry:constant"], "kl_in_reward": False}
    path, cfg = make_config(iterations=2, in_process=True, train={"lr": 1e-2}, score=score)
    run_pipeline(path, [], quiet=True)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, err  # one line per iteration, saying why
    assert warnings[1].startswith("warning: iteration 1: no trainable row (every training row was filtered")
    assert (
        "groups whose task scores (or rewards) are all equal" in warnings[1]
        and "policy is carried forward" in warnings[1]
    )
    for it in (0, 1):
        m = manifests.manifest(layout.folder(cfg.run_dir, it, "train"))
        assert (m["rows"], m["counts"]["steps"]) == (0, 0)
        assert metrics(cfg.run_dir, it).num_rows == 0
    # the policy after two empty iterations is the initial one, byte for byte
    assert max_diff(weights(layout.policy_dir(cfg.run_dir, 1)), weights(tiny_model)) == 0.0
    assert not layout.optimizer_dir(cfg.run_dir, 1).exists()  # no step was ever taken


def test_an_empty_iteration_carries_the_optimizer_state_unchanged(make_config, tiny_model: Path) -> None:
    _, cfg = make_config(train_toml(**KEYS), iterations=3)
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8), iteration=0)
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8).slice(0, 0), iteration=1)
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8, seed=1), iteration=2)
    for it in (0, 1, 2):
        run_stage("train", cfg, it, quiet=True)
    opt0, opt1 = layout.optimizer_dir(cfg.run_dir, 0), layout.optimizer_dir(cfg.run_dir, 1)
    for name in (optim_state.TENSORS, optim_state.META):
        assert (opt1 / name).read_bytes() == (opt0 / name).read_bytes()
    policy = [layout.policy_dir(cfg.run_dir, it) / "model.safetensors" for it in (0, 1)]
    assert policy[1].read_bytes() == policy[0].read_bytes()
    m2 = manifests.manifest(layout.folder(cfg.run_dir, 2, "train"))
    # total = iterations (3) x 4 steps of iteration 0 = 12; iteration 2 goes on at step 4
    assert m2["optimizer"] == {
        "global_step_start": 4,
        "global_step": 8,
        "total_steps": 12,
        "carried_from": 1,
        "changed": {},
    }


def test_a_missing_optimizer_state_is_an_error_unless_asked_to_start_fresh(
    make_config, tiny_model: Path
) -> None:
    _, cfg = make_config(train_toml(**KEYS), iterations=2)
    for it in (0, 1):
        write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8, seed=it), iteration=it)
    run_stage("train", cfg, 0, quiet=True)
    opt0 = layout.optimizer_dir(cfg.run_dir, 0)
    shutil.rmtree(opt0)
    with pytest.raises(
        StageError, match=rf"{opt0}: the optimizer state of iteration 0 is missing.*fresh_optimizer"
    ):
        run_stage("train", cfg, 1, quiet=True)
    assert not layout.folder(cfg.run_dir, 1, "train").exists()  # refused before anything was written
    _, fresh = make_config(train_toml(**KEYS, fresh_optimizer=True), name="fresh.toml", iterations=2)
    m = run_stage("train", fresh, 1, quiet=True)
    # started afresh on purpose, and recorded: no state carried, the schedule from step 0 again
    assert m["optimizer"]["fresh"] is True
    assert (m["optimizer"]["carried_from"], m["optimizer"]["global_step_start"]) == (None, 0)
    assert metrics(cfg.run_dir, 1).column("lr").to_pylist()[0] == pytest.approx(
        1e-2 / 3, rel=1e-6
    )  # warmup 1/3
