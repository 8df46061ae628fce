"""Two real ranks (torchrun, gloo on CPU) train the same policy as one rank on the same data:
with DistributedDataParallel, and with FSDP2 (train.fsdp) killed at a checkpoint and resumed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from rlhf_batch.models import checkpoint
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train.data import load_rows, plan_steps
from rlhf_batch.store import layout, manifests
from tests.stages.test_train import (
    make_table,
    max_diff,
    metrics,
    random_lengths,
    train_toml,
    weights,
    write_advantages,
)

REPO = Path(__file__).parents[2]
# small lr: AdamW turns float noise in near-zero gradient elements into changes of order lr
KEYS = dict(
    lr=1e-4,
    tokens_per_step=12,
    max_tokens_per_batch=20,
    max_padding=1.0,  # micro-batches by the token budget only: the plan asserted below
    ppo_epochs=2,
    recompute_old=True,
    gradient_checkpointing=True,
    kl_loss_coef=0.1,
    entropy_coef=0.01,
)


def torchrun_train(config: Path, iteration: int = 0, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    cmd += ["-m", "rlhf_batch", "train", str(config), "--iter", str(iteration), "-q"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def two_and_one_rank(
    make_config, tiny_model: Path, tmp_path: Path, advantages: list[float] | None = None, **keys: object
):
    """(config path, Config) of a 2-rank run and a 1-rank Config, with the same advantages."""
    prompt_lens, resp_lens = random_lengths(10, seed=3)
    table = make_table(tiny_model, prompt_lens, resp_lens, advantages=advantages)
    # steps of 1, 2 and 3 micro-batches: with 2 ranks, rank 1 sometimes runs only a zero-weight
    # filler row (1), both ranks run real rows (2), rank 1 adds a filler to match rank 0 (3)
    seq_lens = np.array(prompt_lens) + np.array(resp_lens)
    plan = plan_steps(np.array(resp_lens), seq_lens, 12, 20, 2, (0, 0))
    assert {1, 2, 3} <= {len(s.micro) for s in plan}
    path, two = make_config(train_toml(**{**KEYS, **keys}), run_dir=str(tmp_path / "two"))
    _, one = make_config(train_toml(**{**KEYS, **keys}), name="one.toml", run_dir=str(tmp_path / "one"))
    write_advantages(two.run_dir, table)
    write_advantages(one.run_dir, table)
    return path, two, one, len(plan)


def assert_same_training(two, one, n_steps: int, tiny_model: Path, world: int = 2) -> None:
    rows_two, rows_one = metrics(two.run_dir).to_pylist(), metrics(one.run_dir).to_pylist()
    assert len(rows_two) == len(rows_one) == n_steps
    for a, b in zip(rows_two, rows_one, strict=True):
        assert (a["tokens"], a["sequences"]) == (b["tokens"], b["sequences"])
        for k in ("loss", "ratio_mean", "clip_fraction", "kl_to_ref", "entropy", "ess"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), k
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert manifests.manifest(layout.folder(two.run_dir, 0, "train"))["world_size"] == world
    w_two, w_one = weights(layout.policy_dir(two.run_dir, 0)), weights(layout.policy_dir(one.run_dir, 0))
    assert max_diff(w_two, w_one) < 1e-5 < 1e-4 < max_diff(w_one, weights(tiny_model))


@pytest.mark.slow
def test_two_ranks_match_one_rank(make_config, tiny_model: Path, tmp_path: Path) -> None:
    path, two, one, n_steps = two_and_one_rank(make_config, tiny_model, tmp_path)
    done = torchrun_train(path)
    assert done.returncode == 0, done.stderr[-4000:]
    run_stage("train", one, 0, quiet=True)
    assert_same_training(two, one, n_steps, tiny_model)


@pytest.mark.slow
def test_two_ranks_match_one_rank_when_rows_of_advantage_zero_do_not_run(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    # no KL or entropy term: rows 0-4 (advantage 0) run no pass; in the steps made of them alone
    # neither rank runs a forward pass (no gradient sync either), and 2 ranks still train as 1 does
    # (that such a step equals running its rows: test_train.test_rows_of_advantage_zero_...)
    adv = [0.0] * 5 + [0.7, -1.1, 0.4, -0.2, 1.3]
    path, two, one, n_steps = two_and_one_rank(
        make_config, tiny_model, tmp_path, adv, kl_loss_coef=0.0, entropy_coef=0.0
    )
    data = load_rows(layout.folder(one.run_dir, 0, "advantages"))
    plan = plan_steps(data.resp_lens, data.seq_lens, 12, 20, 2, (0, 0), active=np.array(adv) != 0)
    assert any(not s.micro for s in plan) and any(s.micro for s in plan)
    done = torchrun_train(path)
    assert done.returncode == 0, done.stderr[-4000:]
    run_stage("train", one, 0, quiet=True)
    assert_same_training(two, one, n_steps, tiny_model)


@pytest.mark.slow
def test_fsdp_two_ranks_killed_and_resumed_match_one_rank(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    # fsdp is a no-op on one process: the 1-rank run is plain training with the same config
    path, two, one, n_steps = two_and_one_rank(
        make_config, tiny_model, tmp_path, fsdp=True, checkpoint_every=2
    )
    killed = torchrun_train(path, RLHF_BATCH_FAULT="train:checkpoint-4")  # rank 0, once written
    assert killed.returncode != 0
    ckpt = checkpoint.latest(layout.checkpoint_dir(two.run_dir, 0))
    assert ckpt is not None and ckpt.name == "step-00000004" and n_steps > 4
    # written from the gathered full state dicts: AdamW state keyed by parameter name
    state = load_file(str(ckpt / "optimizer.safetensors"))
    assert "model.layers.0.mlp.up_proj.weight/exp_avg" in state
    done = torchrun_train(path)  # resumes from the gathered full state dicts of step 4
    assert done.returncode == 0, done.stderr[-4000:]
    run_stage("train", one, 0, quiet=True)
    assert_same_training(two, one, n_steps, tiny_model)
    # the policy is a plain Hugging Face model dir, written whole by rank 0
    assert weights(layout.policy_dir(two.run_dir, 0)).keys() == weights(tiny_model).keys()
    # the AdamW state the iteration ended with, gathered by name, is the 1-rank one; iteration 1
    # re-shards it over the 2 ranks and goes on as 1 rank does
    opt_two = load_file(str(layout.optimizer_dir(two.run_dir, 0) / "optimizer.safetensors"))
    opt_one = load_file(str(layout.optimizer_dir(one.run_dir, 0) / "optimizer.safetensors"))
    assert opt_two.keys() == opt_one.keys() and max_diff(opt_two, opt_one) < 1e-5
    table = make_table(tiny_model, *random_lengths(10, seed=4))
    write_advantages(two.run_dir, table, iteration=1)
    write_advantages(one.run_dir, table, iteration=1)
    done = torchrun_train(path, iteration=1)
    assert done.returncode == 0, done.stderr[-4000:]
    m = run_stage("train", one, 1, quiet=True)
    assert m["optimizer"]["global_step_start"] == n_steps
    w_two, w_one = weights(layout.policy_dir(two.run_dir, 1)), weights(layout.policy_dir(one.run_dir, 1))
    assert max_diff(w_two, w_one) < 1e-5 < 1e-4 < max_diff(w_one, weights(layout.policy_dir(one.run_dir, 0)))


@pytest.mark.slow
def test_fsdp_on_one_rank_under_torchrun_shards_and_matches_plain(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    """torchrun with one process joins a group of one, so train.fsdp shards (FSDP2 over a mesh of
    one) instead of being a no-op; it trains as plain one-rank training does."""
    path, two, one, n_steps = two_and_one_rank(make_config, tiny_model, tmp_path, fsdp=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone"]
    cmd += ["-m", "rlhf_batch", "train", str(path), "--iter", "0", "-q"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    sharded = manifests.manifest(layout.folder(two.run_dir, 0, "train"))
    assert sharded is not None and sharded["fsdp"] is True and sharded["world_size"] == 1
    plain = run_stage("train", one, 0, quiet=True)
    assert plain["fsdp"] is False
    assert_same_training(two, one, n_steps, tiny_model, world=1)
