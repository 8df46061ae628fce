"""Tests of the train stage: real tiny model, real Parquet parts written with executor.claim.

Expected numbers are worked out by hand in the comments. The advantage stage is not used:
`make_table` builds an advantages table whose behaviour log-probs come from the tiny model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomli_w
import torch
from safetensors.torch import load_file

from rlhf_batch.errors import StageError
from rlhf_batch.models import checkpoint
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train import loop, parallel, save
from rlhf_batch.stages.train.data import Step, cut_balanced, lr_factor, plan_steps
from rlhf_batch.store import layout, manifests, output
from rlhf_batch.store.schemas import ADVANTAGES, METRICS

# ---------------------------------------------------------------------------- helpers


def make_table(
    model_dir: Path,
    prompt_lens: Sequence[int],
    resp_lens: Sequence[int],
    *,
    seed: int = 0,
    advantages: Sequence[float] | None = None,
    old_shift: Sequence[float] | float = 0.0,
    ref_shift: float = 0.0,
) -> pa.Table:
    """Random token ids of the tiny vocab; behaviour log-probs = the model's (temperature 1)
    plus `old_shift` per row; ref = the model's + `ref_shift`; advantages made up unless given."""
    rng = np.random.default_rng(seed)
    n = len(prompt_lens)
    seqs = [rng.integers(5, 100, p + r).tolist() for p, r in zip(prompt_lens, resp_lens, strict=True)]
    model = load_model(str(model_dir), "policy", dtype="float32")
    with torch.no_grad():
        logp, mask, _ = response_logprobs(model, seqs, list(prompt_lens), 1.0, pad_id=1)  # [B, T]
    shifts = [float(old_shift)] * n if isinstance(old_shift, float | int) else list(old_shift)
    true = [logp[i][mask[i]] for i in range(n)]
    adv = rng.normal(size=n).tolist() if advantages is None else list(advantages)
    return pa.table(
        {
            "rollout_id": [f"0000-p{i // 4}-{i % 4}" for i in range(n)],
            "prompt_id": [f"p{i // 4}" for i in range(n)],
            "input_ids": seqs,
            "prompt_len": list(prompt_lens),
            "behavior_logprobs": [(t + s).tolist() for t, s in zip(true, shifts, strict=True)],
            "ref_logprobs": [(t + ref_shift).tolist() for t in true],
            "advantage": adv,
            "reward": [0.0] * n,
            "group_size": [4] * n,
            "group_mean": [0.0] * n,
            "group_std": [1.0] * n,
        }
    )


def write_advantages(run_dir: str | Path, table: pa.Table, iteration: int = 0) -> Path:
    sdir = layout.folder(run_dir, iteration, "advantages")
    stage = output.claim(sdir, "advantage", {"test": True}, {"rows": table.num_rows})
    stage.write_table(0, table, ADVANTAGES)
    stage.finish(1)
    return sdir


def weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def train_toml(**train_keys: object) -> str:
    return tomli_w.dumps({"train": train_keys})


def metrics(run_dir: str | Path, iteration: int = 0) -> pa.Table:
    return pq.read_table(layout.folder(run_dir, iteration, "train") / "metrics.parquet")


def random_lengths(n: int, seed: int = 1) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(2, 5, n).tolist(), rng.integers(1, 7, n).tolist()


# ---------------------------------------------------------------------------- plan (pure)


def test_cut_balanced_makes_contiguous_steps_of_equal_tokens() -> None:
    # 24 tokens / 8 -> 3 steps; row i goes to step (its middle token) * 3 // 24:
    # middles 2, 6, 10, 14, 18, 22 -> 0, 0, 1, 1, 2, 2
    assert cut_balanced([4] * 6, 8) == [[0, 1], [2, 3], [4, 5]]
    # 8 tokens / 4 -> 2 steps; middles 1.5, 3.5, 4.5, 6.5 -> x 2 / 8 -> 0, 0, 1, 1 (sums 4 and 4)
    assert cut_balanced([3, 1, 1, 3], 4) == [[0, 1], [2, 3]]
    # chunky items of about the budget land one per step: 192 tokens / 64 -> 3 steps;
    # middles 28, 87, 148 -> x 3 / 192 -> 0, 1, 2 (by first tokens, 0, 56, 118: 0, 0, 1)
    assert cut_balanced([56, 62, 60], 64) == [[0], [1], [2]]
    # 5 tokens / 100 -> 1 step with every row
    assert cut_balanced([2, 3], 100) == [[0, 1]]


def test_plan_keeps_row_order_then_reshuffles_micro_batches() -> None:
    resp, seq = np.array([4] * 6), np.array([7] * 6)
    # epoch 0: steps of 8 tokens = rows (0,1), (2,3), (4,5); 2 rows x 7 tokens fit a budget of 14
    plan = plan_steps(resp, seq, tokens_per_step=8, max_tokens_per_batch=14, epochs=2, seed=(0, 0))
    assert [s.micro for s in plan[:3]] == [((0, 1),), ((2, 3),), ((4, 5),)]
    assert [(s.index, s.epoch, s.tokens, s.sequences) for s in plan] == [
        (0, 0, 8, 2),
        (1, 0, 8, 2),
        (2, 0, 8, 2),
        (3, 1, 8, 2),
        (4, 1, 8, 2),
        (5, 1, 8, 2),
    ]
    # epoch 1: the same three micro-batches, one per step, in a seeded order
    assert sorted(s.micro for s in plan[3:]) == [((0, 1),), ((2, 3),), ((4, 5),)]
    assert plan == plan_steps(resp, seq, 8, 14, 2, (0, 0))


def test_plan_micro_batches_respect_the_token_budget() -> None:
    resp, seq = np.array([1, 2, 3, 4, 5, 6]), np.array([3, 4, 5, 6, 7, 8])
    # one step (21 tokens <= 100); budget 10 -> rows longest first: (5) 8, (4) 7, (3,2) 2x6=12>10 ...
    (step,) = plan_steps(resp, seq, 100, 10, 1, (0, 0))
    assert sorted(i for mb in step.micro for i in mb) == [0, 1, 2, 3, 4, 5]
    assert all(len(mb) * max(seq[list(mb)]) <= 10 for mb in step.micro)
    assert (step.tokens, step.sequences) == (21, 6)


def test_plan_with_sequences_per_step_counts_rows_not_tokens() -> None:
    # 6 rows of 1, 1, 1, 9, 9, 9 response tokens; 2 rows per step -> ceil(6 / 2) = 3 steps of
    # 2 rows each (row i to step (2i + 1) x 3 // 12), whatever their tokens
    resp, seq = np.array([1, 1, 1, 9, 9, 9]), np.array([3, 3, 3, 11, 11, 11])
    plan = plan_steps(resp, seq, 15, 100, 2, (0, 0), sequences_per_step=2)
    rows = [sorted(i for mb in s.micro for i in mb) for s in plan]  # (a micro-batch runs longest first)
    assert rows[:3] == [[0, 1], [2, 3], [4, 5]]
    # tokens of each step: 1 + 1, 1 + 9, 9 + 9; epoch 1 cuts the same 3 micro-batches again
    assert [(s.epoch, s.tokens, s.sequences) for s in plan[:3]] == [(0, 2, 2), (0, 10, 2), (0, 18, 2)]
    assert sorted(rows[3:]) == [[0, 1], [2, 3], [4, 5]]
    assert [s.sequences for s in plan[3:]] == [2, 2, 2]
    # the same rows cut by tokens: middles 0.5, 1.5, 2.5, 7.5, 16.5, 25.5 of 30 x 2 // 30 -> 0, 0, 0, 0, 1, 1
    by_tokens = plan_steps(resp, seq, 15, 100, 1, (0, 0))
    assert [sorted(i for mb in s.micro for i in mb) for s in by_tokens] == [[0, 1, 2, 3], [4, 5]]


def test_plan_leaves_idle_rows_out_of_the_micro_batches_not_out_of_the_counts() -> None:
    # 6 rows of 2 response tokens, 2 rows per step, 2 epochs; rows 0, 1 and 3 idle (advantage 0)
    resp, seq = np.array([2] * 6), np.array([5] * 6)
    active = np.array([False, False, True, False, True, True])
    plan = plan_steps(resp, seq, 15, 100, 2, (0, 0), sequences_per_step=2, active=active)
    full = plan_steps(resp, seq, 15, 100, 2, (0, 0), sequences_per_step=2)
    # epoch 0: rows (0, 1), (2, 3), (4, 5), each step counting 2 rows x 2 tokens; step 0 runs
    # nothing, step 1 row 2 alone
    assert [(s.tokens, s.sequences) for s in plan[:3]] == [(4, 2)] * 3
    assert [s.micro for s in plan[:3]] == [(), ((2,),), ((4, 5),)]
    # every step of both epochs is the step of all rows, counts included, without its idle rows
    assert len(plan) == len(full) == 6
    for p, f in zip(plan, full, strict=True):
        assert (p.index, p.epoch, p.tokens, p.sequences, p.filler) == (
            f.index,
            f.epoch,
            f.tokens,
            f.sequences,
            f.filler,
        )
        kept = [tuple(i for i in mb if active[i]) for mb in f.micro]
        assert p.micro == tuple(mb for mb in kept if mb)


def test_step_for_rank_pads_short_ranks_with_a_zero_weight_row() -> None:
    step = Step(index=0, epoch=0, micro=((0, 1), (2,), (3,)), tokens=9, sequences=4, filler=2)
    # 3 micro-batches on 2 ranks: rank 0 gets #0 and #2, rank 1 gets #1 and a weight-0 filler
    assert step.for_rank(0, 2) == [((0, 1), 1.0), ((3,), 1.0)]
    assert step.for_rank(1, 2) == [((2,), 1.0), ((2,), 0.0)]
    assert step.for_rank(0, 1) == [((0, 1), 1.0), ((2,), 1.0), ((3,), 1.0)]


def test_lr_factor_warmup_then_decay() -> None:
    # warmup 2 of 6 steps: (s + 1) / 2 -> 0.5, 1.0; then progress (s - 2) / 4
    assert lr_factor(0, 6, 2, "cosine") == pytest.approx(0.5)
    assert lr_factor(1, 6, 2, "cosine") == pytest.approx(1.0)
    assert lr_factor(2, 6, 2, "cosine") == pytest.approx(1.0)  # cos(0)
    assert lr_factor(3, 6, 2, "cosine") == pytest.approx(0.853553, abs=1e-6)  # 0.5 (1 + cos(pi/4))
    assert lr_factor(5, 6, 2, "cosine") == pytest.approx(0.146447, abs=1e-6)  # 0.5 (1 + cos(3pi/4))
    assert lr_factor(4, 6, 2, "linear") == pytest.approx(0.5)  # 1 - 2/4
    assert lr_factor(5, 6, 0, "constant") == 1.0


# ---------------------------------------------------------------------------- checkpoint


def test_checkpoint_roundtrip_keeps_only_the_newest(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    root = tmp_path / "checkpoint"
    (root / ".tmp-step-00000009-1").mkdir(parents=True)  # a kill during a save: ignored
    checkpoint.save(root, 1, model, opt, {"key": "k", "metrics": []})
    checkpoint.save(root, 2, model, opt, {"key": "k", "metrics": [{"a": 1.5}]})
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]
    after_save = torch.rand(4)  # what a run that was not stopped draws next
    torch.manual_seed(123)  # a resumed process starts from another random state

    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = checkpoint.load_latest(root, fresh, fresh_opt, "k", "cpu")
    assert state is not None and state["next_step"] == 2 and state["metrics"] == [{"a": 1.5}]
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(torch.rand(4), after_save)  # the random state is restored too
    exp_avg = fresh_opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(StageError, match="another config"):
        checkpoint.load_latest(root, fresh, fresh_opt, "other", "cpu")


# ---------------------------------------------------------------------------- the stage


def test_train_writes_policy_metrics_and_manifest(make_config, tiny_model: Path) -> None:
    # 12 rows, prompt 3 + response 4 tokens: 48 tokens; 16 per step -> 3 steps per epoch
    path, cfg = make_config(
        train_toml(lr=1e-2, tokens_per_step=16, max_tokens_per_batch=14, ppo_epochs=2, checkpoint_every=2)
    )
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 12, [4] * 12))
    m = run_stage("train", cfg, 0, quiet=True)

    table = metrics(cfg.run_dir)
    assert table.schema.remove_metadata().equals(METRICS)
    # epoch 1: 6 micro-batches of 2 rows (2 x 7 <= 14), 8 tokens each, regrouped 2 per step -> 3 steps
    assert table.column("step").to_pylist() == [0, 1, 2, 3, 4, 5]
    assert table.column("epoch").to_pylist() == [0, 0, 0, 1, 1, 1]
    assert table.column("tokens").to_pylist() == [16] * 6
    assert table.column("sequences").to_pylist() == [4] * 6
    assert table.column("lr").to_pylist() == [1e-2] * 6
    # before the first update the policy is the behaviour policy: ratio 1, nothing clipped
    first = table.slice(0, 1).to_pylist()[0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["clip_fraction"] == 0.0
    assert first["kl_approx"] == pytest.approx(0.0, abs=1e-6)
    assert first["ess"] == pytest.approx(1.0, abs=1e-5)
    assert table.column("ratio_mean").to_pylist()[-1] != pytest.approx(1.0, abs=1e-4)  # it did learn

    sdir = layout.folder(cfg.run_dir, 0, "train")
    assert m == manifests.manifest(sdir)
    counts = m["counts"]  # 48 tokens x 2 epochs
    assert (m["rows"], counts["steps"], counts["sequences"], counts["tokens"]) == (6, 6, 12, 96)
    # no checkpoint left; the AdamW state the next iteration continues from
    assert sorted(p.name for p in sdir.iterdir()) == [
        "_manifest.json",
        "metrics.parquet",
        "optimizer",
        "rollout_stats.parquet",
    ]
    # one diagnostics row per rollout and epoch; step 0's rollouts ran on the behaviour policy:
    # ratio 1, |trainer - behaviour| ~ 0, weight 1, nothing clipped or masked
    stats = pq.read_table(sdir / "rollout_stats.parquet").to_pylist()
    assert len(stats) == 2 * counts["sequences"] and {r["epoch"] for r in stats} == {0, 1}
    for epoch in (0, 1):  # every rollout once an epoch (make_table's ids)
        ids = sorted(r["rollout_id"] for r in stats if r["epoch"] == epoch)
        assert ids == sorted(f"0000-p{i // 4}-{i % 4}" for i in range(12))
    assert sum(r["tokens"] for r in stats) == counts["tokens"]
    for r in (r for r in stats if r["step"] == 0):
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and r["ratio_max"] == pytest.approx(
            1.0, abs=1e-5
        )
        assert r["logprob_diff_max"] < 1e-5 and r["is_weight"] == 1.0
        assert (r["clipped_tokens"], r["masked_tokens"]) == (0, 0)
    # entropy_coef 0: the entropy is computed for the metric on each step's first micro-batch
    # only, so its rows have a mean entropy (> 0) and the others none
    ent = [r["entropy_mean"] for r in stats]
    assert any(e is not None for e in ent) and all(e is None or e > 0 for e in ent)
    assert sorted(p.name for p in (sdir / "optimizer").iterdir()) == [
        "optimizer.json",
        "optimizer.safetensors",
    ]
    assert m["optimizer"] == {
        "global_step_start": 0,
        "global_step": 6,
        "total_steps": 6,  # iterations (1) x 6 steps
        "carried_from": None,
        "changed": {},
    }
    assert max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(tiny_model)) > 1e-3


def test_policy_loads_with_transformers_and_generates(make_config, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, cfg = make_config(train_toml(lr=1e-2))
    write_advantages(cfg.run_dir, make_table(tiny_model, *random_lengths(8)))
    run_stage("train", cfg, 0, quiet=True)
    out = layout.policy_dir(cfg.run_dir, 0)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("count the a", return_tensors="pt")
    gen = model.generate(
        **ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id
    )
    assert gen.shape == (1, ids["input_ids"].shape[1] + 3)
    assert model.dtype == torch.float32  # saved in the starting checkpoint's dtype


def test_lr_zero_leaves_the_weights_unchanged(make_config, tiny_model: Path) -> None:
    _, cfg = make_config(train_toml(lr=0.0, weight_decay=0.1, tokens_per_step=8, ppo_epochs=2))
    write_advantages(cfg.run_dir, make_table(tiny_model, *random_lengths(8)))
    run_stage("train", cfg, 0, quiet=True)
    assert max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(tiny_model)) == 0.0
    assert all(g > 0 for g in metrics(cfg.run_dir).column("grad_norm").to_pylist())  # gradients were there


def test_progress_bar_shows_steps_loss_clip_kl_and_tokens_per_second(
    make_config, tiny_model: Path, capsys
) -> None:
    # 8 rows x 4 response tokens, 16 per step: 2 steps; the bar ends on the last step's numbers
    _, cfg = make_config(train_toml(lr=1e-2, tokens_per_step=16, ppo_epochs=1))
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 8, [4] * 8))
    run_stage("train", cfg, 0, quiet=False)
    last = capsys.readouterr().err.split("\r")[-1]
    row = metrics(cfg.run_dir).to_pylist()[-1]
    assert "train iter=0" in last and "2/2" in last
    assert f"loss={row['loss']:.4g}" in last and f"clip={row['clip_fraction']:.3f}" in last
    assert f"kl={row['kl_approx']:.2e}" in last and "tok_s=" in last


def test_sequences_per_step_sets_the_rows_of_each_optimizer_step(make_config, tiny_model: Path) -> None:
    # 10 rows of 4 response tokens, 3 rows per step: ceil(10 / 3) = 4 steps an epoch, 2 epochs;
    # row i goes to step (2i + 1) x 4 // 20: 0, 0, 1, 1, 1, 2, 2, 3, 3, 3 -> 2, 3, 2, 3 rows
    _, cfg = make_config(train_toml(lr=1e-2, tokens_per_step=1000, sequences_per_step=3, ppo_epochs=2))
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 10, [4] * 10))
    m = run_stage("train", cfg, 0, quiet=True)
    rows = metrics(cfg.run_dir).to_pylist()
    assert m["counts"]["steps"] == 8 and [r["sequences"] for r in rows[:4]] == [2, 3, 2, 3]
    assert [r["tokens"] for r in rows[:4]] == [8, 12, 8, 12]
    assert sum(r["sequences"] for r in rows[4:]) == 10  # epoch 1: the same rows again
    assert m["config"]["train"]["sequences_per_step"] == 3  # it decides the result: recorded


def test_lr_schedule_and_grad_norm_in_the_metrics(make_config, tiny_model: Path) -> None:
    # 12 rows x 4 tokens, 8 per step: 6 steps; warmup 2 then cosine over 4 (see test_lr_factor):
    # 0.01 x [0.5, 1, 1, 0.853553, 0.5, 0.146447]
    keys = dict(lr=0.01, warmup_steps=2, lr_schedule="cosine", tokens_per_step=8, max_grad_norm=1e-6)
    _, cfg = make_config(train_toml(**keys))
    write_advantages(cfg.run_dir, make_table(tiny_model, [3] * 12, [4] * 12))
    run_stage("train", cfg, 0, quiet=True)
    table = metrics(cfg.run_dir)
    expected = [0.005, 0.01, 0.01, 0.00853553, 0.005, 0.00146447]
    assert table.column("lr").to_pylist() == pytest.approx(expected, abs=1e-8)
    # the norm is logged before clipping to 1e-6
    assert min(table.column("grad_norm").to_pylist()) > 1e-3


def test_grad_clipping_shrinks_the_update(make_config, tiny_model: Path, tmp_path: Path) -> None:
    # One AdamW step (weight decay 0) moves each weight by lr * g / (|g| + eps), eps = 1e-8
    # (first step: the bias-corrected moments are g and g^2). Unclipped, some |g| >> 1e-8, so the
    # largest move is ~lr = 0.01. Clipped to a total norm of 1e-9, every |g| <= 1e-9, so no weight
    # moves more than lr * 1e-9 / (1e-9 + 1e-8) = lr / 11 = 0.00091.
    table = make_table(tiny_model, *random_lengths(8))
    moved = {}
    for max_norm in (0.0, 1e-9):  # 0: no clipping
        keys = dict(lr=0.01, weight_decay=0.0, ppo_epochs=1, max_grad_norm=max_norm)
        _, cfg = make_config(
            train_toml(**keys), name=f"{max_norm}.toml", run_dir=str(tmp_path / str(max_norm))
        )
        write_advantages(cfg.run_dir, table)
        run_stage("train", cfg, 0, quiet=True)
        assert metrics(cfg.run_dir).num_rows == 1
        moved[max_norm] = max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(tiny_model))
    assert moved[0.0] > 0.009
    assert moved[1e-9] < 0.01 / 11 + 1e-6


def test_old_logprobs_stored_or_recomputed(make_config, tiny_model: Path) -> None:
    # behaviour log-probs stored 0.5 below the model's: log r = 0.5 on every token -> r = e^0.5
    table = make_table(tiny_model, *random_lengths(8), old_shift=-0.5)
    _, cfg = make_config(train_toml(lr=0.0))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    assert metrics(cfg.run_dir).column("ratio_mean")[0].as_py() == pytest.approx(1.648721, abs=1e-5)
    # recompute_old: the old log-probs are the starting policy's, so r = 1 again
    _, cfg2 = make_config(
        train_toml(lr=0.0, recompute_old=True), name="b.toml", run_dir=str(Path(cfg.run_dir).parent / "b")
    )
    write_advantages(cfg2.run_dir, table)
    run_stage("train", cfg2, 0, quiet=True)
    first = metrics(cfg2.run_dir).slice(0, 1).to_pylist()[0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["clip_fraction"] == 0.0


def test_ess_and_clip_fraction_are_over_the_whole_step(make_config, tiny_model: Path) -> None:
    # two 1-token responses, one micro-batch each; row 1's behaviour is ln 2 lower -> w = 1 and 2
    # ess = (1 + 2)^2 / (2 (1 + 4)) = 0.9 ; ratio_mean = 1.5 ; A > 0 and r = 2 > 1.2 binds on 1 of 2
    table = make_table(tiny_model, [3, 3], [1, 1], advantages=[1.0, 1.0], old_shift=[0.0, -math.log(2)])
    _, cfg = make_config(train_toml(lr=0.0, max_tokens_per_batch=4))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["ess"] == pytest.approx(0.9, abs=1e-5)
    assert row["ratio_mean"] == pytest.approx(1.5, abs=1e-5)
    assert row["clip_fraction"] == pytest.approx(0.5)
    # token_mean over 2 tokens: -(1 * 1 + 1.2 * 1) / 2 = -1.1
    assert row["loss_objective"] == pytest.approx(-1.1, abs=1e-5)


def test_tis_cap_recomputes_old_and_weights_tokens_by_the_capped_behaviour_ratio(
    make_config, tiny_model: Path
) -> None:
    # two 1-token responses, A = 1; row 1's behaviour log-prob is ln 4 below the policy's.
    # tis_cap recomputes old (= the policy: PPO ratio r = 1 on both rows) and weighs each token by
    # min(exp(old - behaviour), 2): row 0 exp(0) = 1, row 1 exp(ln 4) = 4 -> 2.
    # token_mean objective = -(1 * 1 * 1 + 1 * 1 * 2) / 2 = -1.5
    # (recompute_old alone: -(1 + 1) / 2 = -1; neither: row 1's r = 4 clips at 1.2 -> -1.1)
    table = make_table(tiny_model, [3, 3], [1, 1], advantages=[1.0, 1.0], old_shift=[0.0, -math.log(4)])
    _, cfg = make_config(train_toml(lr=0.0, max_tokens_per_batch=4, tis_cap=2.0))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert row["loss_objective"] == pytest.approx(-1.5, abs=1e-5)


def test_masked_importance_sampling_drops_tokens_and_reports_their_share(
    make_config, tiny_model: Path
) -> None:
    # three 1-token responses, A = 1; behaviour ln 1, ln 2, ln 4 below the policy: the recomputed
    # anchor gives r = 1 and w = 1, 2, 4; tis_mode "mask", band [0, 3] (tis_cap unset: 3): weights
    # 1, 2, 0. token_mean objective = -(1 + 2 + 0) / 3 = -1; 1 token of 3 masked.
    # (truncation at 3 instead: -(1 + 2 + 3) / 3 = -2)
    shifts = [0.0, -math.log(2), -math.log(4)]
    table = make_table(tiny_model, [3, 3, 3], [1, 1, 1], advantages=[1.0, 1.0, 1.0], old_shift=shifts)
    _, cfg = make_config(train_toml(lr=0.0, max_tokens_per_batch=6, tis_mode="mask"))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["loss_objective"] == pytest.approx(-1.0, abs=1e-5)
    assert row["tis_masked"] == pytest.approx(1 / 3, abs=1e-6)


def test_sequence_ratio_is_the_rows_geometric_mean_in_train(make_config, tiny_model: Path) -> None:
    # two rows of 2 response tokens, behaviour 0.0002 and 0.001 below the policy on every token
    # (stored, not recomputed): s = e^0.0002 = 1.0002 (inside [1 - 3e-4, 1 + 4e-4]) and
    # e^0.001 = 1.0010005 (> 1.0004, A = 1: the clip binds on row 1's 2 tokens: clip_fraction 0.5).
    # seq_mean_token_mean objective = -(1.0002 + 1.0004) / 2 = -1.0003
    table = make_table(tiny_model, [3, 3], [2, 2], advantages=[1.0, 1.0], old_shift=[-2e-4, -1e-3])
    keys = {"lr": 0.0, "ratio_level": "sequence", "aggregation": "seq_mean_token_mean"}
    _, cfg = make_config(train_toml(**keys))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["loss_objective"] == pytest.approx(-1.0003, abs=2e-6)
    assert row["clip_fraction"] == pytest.approx(0.5)


def test_cispo_weighs_every_token_by_its_truncated_ratio_in_train(make_config, tiny_model: Path) -> None:
    # behaviour stored 0.5 and 2.0 below the policy: r = e^0.5 = 1.648721 (row 0, 2 tokens) and
    # e^2 = 7.389056 -> capped at cispo_max 5 (row 1, 1 token); A = 1, -1. Per token -w A logp with
    # logp = behaviour + shift (the policy's own): token_mean over 3 tokens. The cap binds on 1 of 3.
    table = make_table(tiny_model, [3, 3], [2, 1], advantages=[1.0, -1.0], old_shift=[-0.5, -2.0])
    _, cfg = make_config(train_toml(lr=0.0, loss="cispo"))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    beh = table.column("behavior_logprobs").to_pylist()
    terms = [-math.exp(0.5) * 1.0 * (b + 0.5) for b in beh[0]] + [-5.0 * -1.0 * (b + 2.0) for b in beh[1]]
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["loss_objective"] == pytest.approx(sum(terms) / 3, abs=1e-5)
    assert row["clip_fraction"] == pytest.approx(1 / 3)


def test_a_stale_run_trains_with_the_decoupled_objective_by_default(make_config, tiny_model: Path) -> None:
    # max_staleness = 1, no train keys set: recompute_old (the anchor is the policy: r = 1) and the
    # weight min(exp(old - behaviour), 5). Row 1's behaviour is ln 8 below: w = 8 -> 5; row 0's w = 1.
    # token_mean objective = -(1 * 1 * 1 + 1 * 1 * 5) / 2 = -3
    # (lock-step defaults: row 1's r = 8 clips at 1.2 -> -(1 + 1.2) / 2 = -1.1)
    table = make_table(tiny_model, [3, 3], [1, 1], advantages=[1.0, 1.0], old_shift=[0.0, -math.log(8)])
    _, cfg = make_config(train_toml(lr=0.0, max_tokens_per_batch=4), max_staleness=1)
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert row["loss_objective"] == pytest.approx(-3.0, abs=1e-5)


def test_kl_to_ref_and_entropy_in_the_loss(make_config, tiny_model: Path) -> None:
    # ref = policy - 0.3 on every token: k3 = e^-0.3 + 0.3 - 1 = 0.040818 ; loss term 0.5 * that
    table = make_table(tiny_model, *random_lengths(8), advantages=[0.0] * 8, ref_shift=-0.3)
    _, cfg = make_config(train_toml(lr=0.0, kl_loss_coef=0.5, entropy_coef=0.01))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["kl_to_ref"] == pytest.approx(0.040818, abs=1e-5)
    assert row["loss_kl_to_ref"] == pytest.approx(0.020409, abs=1e-5)
    vocab = 105  # the tiny char tokenizer: entropy is in (0, ln V]
    assert 0 < row["entropy"] <= math.log(vocab) + 1e-4
    assert row["loss_entropy"] == pytest.approx(-0.01 * row["entropy"], rel=1e-5)
    # A = 0: the objective is 0; loss = kl term + entropy term
    assert row["loss"] == pytest.approx(row["loss_kl_to_ref"] + row["loss_entropy"], abs=1e-6)


def test_kl_to_the_behaviour_policy_is_a_metric(make_config, tiny_model: Path) -> None:
    # behaviour log-probs stored 0.5 below the model's: old - logp = -0.5 on every token;
    # k3 = e^-0.5 - (-0.5) - 1 = 0.606531 + 0.5 - 1 = 0.106531 ; loss term 0.2 * that = 0.021306
    # (the other direction, r - 1 - log r = e^0.5 - 1.5 = 0.148721, is kl_approx: not this term)
    table = make_table(tiny_model, *random_lengths(8), advantages=[0.0] * 8, old_shift=-0.5)
    _, cfg = make_config(train_toml(lr=0.0, kl_to_inference_coef=0.2, tokens_per_step=12))
    write_advantages(cfg.run_dir, table)
    run_stage("train", cfg, 0, quiet=True)
    rows = metrics(cfg.run_dir).to_pylist()
    assert len(rows) > 1  # lr = 0: every step sees the same policy, so the same numbers
    for row in rows:
        assert row["loss_kl_to_inference"] == pytest.approx(0.021306, abs=1e-5)
        assert row["kl_approx"] == pytest.approx(0.148721, abs=1e-5)
        # A = 0 and no other coefficient: the KL term is the whole loss
        assert row["loss"] == pytest.approx(row["loss_kl_to_inference"], abs=1e-7)
    # off by default: the column is there and 0
    _, off = make_config(train_toml(lr=0.0), name="off.toml", run_dir=str(Path(cfg.run_dir).parent / "off"))
    write_advantages(off.run_dir, table)
    run_stage("train", off, 0, quiet=True)
    assert set(metrics(off.run_dir).column("loss_kl_to_inference").to_pylist()) == {0.0}


def test_bf16_autocast_step_on_cpu(make_config, tiny_model: Path) -> None:
    """dtype = bfloat16 switches autocast on (train.build_trainer: autocast_bf16 and the dtype resolves to
    bfloat16, which it does on any CPU when asked by name). One step against the float32 step."""
    from rlhf_batch.stages.train.data import load_rows

    _, cfg = make_config(train_toml(lr=1e-3))
    data = load_rows(write_advantages(cfg.run_dir, make_table(tiny_model, *random_lengths(8))))
    steps = plan_steps(data.resp_lens, data.seq_lens, 10**6, 10**6, 1, (0, 0))  # one step, one micro-batch
    out = {}
    for dtype in ("float32", "bfloat16"):
        _, cfg = make_config(train_toml(lr=1e-3), name=f"{dtype}.toml", dtype=dtype)
        trainer = parallel.build_trainer(cfg, str(tiny_model), data, steps)
        row = trainer.step(steps[0])
        params = list(trainer.model.parameters())
        out[dtype] = (trainer.bf16, row, {p.dtype for p in params}, {p.grad.dtype for p in params})
    (on32, f32, _, _), (on16, bf, weights16, grads16) = out["float32"], out["bfloat16"]
    assert (on32, on16) == (False, True)
    assert weights16 == grads16 == {torch.float32}  # master weights and their gradients stay float32
    assert math.isfinite(bf["loss"]) and math.isfinite(bf["grad_norm"])
    assert bf["loss"] != f32["loss"]  # the bf16 path did run: its log-probs are rounded
    # bf16 rounds the matmul inputs to 8 significant bits (relative 2^-8 = 0.004); this untrained
    # model's logits are small, so its log-probs move by ~1e-3 (measured: max 9.6e-4, mean 4.9e-4 over
    # the 25 tokens), the ratios exp(logp - old) by ~0.1%, and the loss, a mean of -ratio * A with
    # |A| <= 1.01 here, by at most ~1e-3 (measured: 4e-5). 5e-3 is 5x that bound and 57x below the
    # loss itself (0.287). The gradient norm moved by 7e-5 relative; 1% allows the same margin.
    assert bf["loss"] == pytest.approx(f32["loss"], abs=5e-3)
    assert bf["ratio_mean"] == pytest.approx(f32["ratio_mean"], abs=2e-3)
    assert bf["grad_norm"] == pytest.approx(f32["grad_norm"], rel=1e-2)


def test_a_bf16_step_casts_each_weight_once_and_sums_the_same_gradients(
    make_config, tiny_model: Path
) -> None:
    """Autocast's bf16 copies of the weights live for the whole step (Trainer._step_casts): each
    weight is cast once, not once per micro-batch, and the gradients equal those of micro-batches
    each run in an autocast of its own (the same bf16 values, summed in the same order)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhf_batch.core.losses import grpo_loss
    from rlhf_batch.stages.train.data import load_rows, micro_batch

    _, cfg = make_config(train_toml(lr=0.0, max_grad_norm=0.0), dtype="bfloat16")
    data = load_rows(write_advantages(cfg.run_dir, make_table(tiny_model, *random_lengths(8))))
    steps = plan_steps(
        data.resp_lens, data.seq_lens, 10**6, 12, 1, (0, 0)
    )  # one step, 12-token micro-batches
    trainer = parallel.build_trainer(cfg, str(tiny_model), data, steps)
    work = steps[0].for_rank(0, 1)
    assert trainer.bf16 and len(work) >= 3
    head = trainer.model.get_output_embeddings()  # the LM head casts its weight itself, per call
    layers = [m for m in trainer.model.modules() if type(m) is torch.nn.Linear and m is not head]
    weights_at = {m.weight.untyped_storage().data_ptr() for m in layers}

    class WeightCasts(TorchDispatchMode):
        """Counts casts of the decoder's nn.Linear weights to bf16 (by the memory they read)."""

        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in weights_at:
                self.n += kwargs.get("dtype") == torch.bfloat16
            return func(*args, **kwargs)

    with WeightCasts() as casts:
        trainer.step(steps[0])
    stepped = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    assert casts.n == len(layers) > 0  # once a step (it was once per micro-batch: len(work) x as many)

    trainer.model.zero_grad(set_to_none=True)
    for rows, weight in work:  # each micro-batch in its own autocast, as one would write it
        td = micro_batch(data, rows, "cpu")
        logp, mask, ent = trainer.forward(td)
        out = grpo_loss(logp, td["old_logprobs"], td["advantages"], mask, ref_logprobs=td["ref_logprobs"],
                        entropy=ent.detach(), denominator=float(steps[0].tokens), **trainer.loss_kwargs)  # fmt: skip
        (out.loss * weight).backward()
    assert all(torch.equal(p.grad, stepped[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_finds_one_nan_or_inf_anywhere(dtype: torch.dtype) -> None:
    # the check the stage runs on every trained weight before writing the policy
    w = torch.randn(300, 70).to(dtype)
    assert save._finite(w) and save._finite(w[:0])
    for pos in [(0, 0), (123, 45), (299, 69)]:
        for bad in (math.nan, math.inf, -math.inf):
            x = w.clone()
            x[pos] = bad
            assert not save._finite(x), (pos, bad)
    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)  # finite, however large
    assert save._finite(big) and save._finite(-big)


def test_rows_of_advantage_zero_are_not_run_and_change_nothing(
    make_config, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without KL or entropy terms a row of advantage 0 has a zero gradient: the plan skips its
    forward pass but keeps it in the step's normaliser. Trained both ways, the weights agree."""
    from rlhf_batch.observe.report import write_report
    from rlhf_batch.observe.status import print_status
    from rlhf_batch.stages.train.data import load_rows

    # 8 rows, 4 per step, 2 epochs: rows 0-3 all of advantage 0, rows 4-7 two of them 0; epoch 1
    # runs the same two micro-batches as steps again, in a seeded order
    adv = [0.0, 0.0, 0.0, 0.0, 0.9, 0.0, -1.2, 0.0]
    table = make_table(tiny_model, *random_lengths(8), advantages=adv, old_shift=0.05)
    _, cfg = make_config(train_toml(lr=1e-4, sequences_per_step=4, ppo_epochs=2))
    data = load_rows(write_advantages(cfg.run_dir, table))
    active = loop._active_rows(cfg.train, data)
    assert active is not None and active.tolist() == [a != 0 for a in adv]
    args = (data.resp_lens, data.seq_lens, 10**6, 10**6, 2, (0, 0))
    plan = plan_steps(*args, sequences_per_step=4, active=active)
    full = plan_steps(*args, sequences_per_step=4)
    idle = [i for i, s in enumerate(plan) if not s.micro]  # steps of rows 0-3
    assert len(idle) == 2 and [sorted(plan[i].micro[0]) for i in range(4) if i not in idle] == [[4, 6]] * 2
    assert [len(s.micro[0]) for s in full] == [4, 4, 4, 4]
    out = {}
    for name, steps in (("skipped", plan), ("run", full)):
        trainer = parallel.build_trainer(cfg, str(tiny_model), data, steps)
        rows = [trainer.step(s) for s in steps]
        out[name] = (rows, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    (skipped, w_skip), (run, w_run) = out["skipped"], out["run"]
    for i in idle:
        # zero gradient either way (every term of the loss is a multiple of A = 0); AdamW still
        # steps (its moments decay, weight decay applies), identically in both
        assert skipped[i]["grad_norm"] == run[i]["grad_norm"] == 0.0
        # no row ran: no token means, no ESS, no tokens/s (the run's are numbers)
        assert [skipped[i][k] for k in ("ratio_mean", "clip_fraction", "entropy", "ess")] == [None] * 4
        assert skipped[i]["tokens_per_s"] == 0.0 and run[i]["ratio_mean"] > 0 and run[i]["ess"] > 0
    # the normaliser counts rows 5 and 7 too: the loss of a mixed step is the same number both ways
    assert [r["tokens"] for r in skipped] == [r["tokens"] for r in run]
    assert sorted({r["tokens"] for r in run}) == sorted(
        {int(data.resp_lens[:4].sum()), int(data.resp_lens[4:].sum())}
    )
    for a, b in zip(skipped, run, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    initial = {k: v for k, v in weights(tiny_model).items() if k in w_skip}
    w_skip, w_run = ({k: v for k, v in w.items() if k in initial} for w in (w_skip, w_run))  # tied head once
    assert max_diff(w_skip, w_run) < 1e-6 < 1e-5 < max_diff(w_skip, initial)
    # the stage writes the idle steps' token means as nulls, which status and the report skip
    run_stage("train", cfg, 0, quiet=True)
    steps_table = metrics(cfg.run_dir)
    # (its plan cuts micro-batches by train.max_padding: epoch 0's first step, rows 0-3, is idle)
    assert steps_table.num_rows == 4 and steps_table["ratio_mean"][0].as_py() is None
    write_report(cfg.run_dir, tensorboard=True)
    assert (Path(cfg.run_dir) / "report" / "train.png").is_file()
    print_status(cfg.run_dir)
    status = capsys.readouterr().out
    assert "train" in status and "nan" not in status.lower()
    # with an entropy term every row moves the loss: nothing is skipped
    _, cfg_e = make_config(train_toml(entropy_coef=0.01), name="e.toml")
    assert loop._active_rows(cfg_e.train, data) is None


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batching_does_not_change_a_step(
    make_config, tiny_model: Path, tmp_path: Path, aggregation: str
) -> None:
    # one step per epoch, 2 epochs; micro-batches of one row (budget 7) vs one micro-batch (1000).
    # A small lr: AdamW divides each gradient element by its magnitude, so float noise in near-zero
    # gradients (k_proj.bias: exactly 0 in theory) becomes a change of order lr.
    table = make_table(tiny_model, [3] * 8, [1, 2, 3, 4, 4, 3, 2, 1])
    results = []
    for name, budget in (("a", 7), ("b", 1000)):
        keys = dict(lr=1e-4, aggregation=aggregation, ppo_epochs=2, max_tokens_per_batch=budget)
        _, cfg = make_config(train_toml(**keys), name=f"{name}.toml", run_dir=str(tmp_path / name))
        write_advantages(cfg.run_dir, table)
        run_stage("train", cfg, 0, quiet=True)
        results.append((metrics(cfg.run_dir).to_pylist(), weights(layout.policy_dir(cfg.run_dir, 0))))
    (rows_a, w_a), (rows_b, w_b) = results
    assert len(rows_a) == len(rows_b) == 2
    for a, b in zip(rows_a, rows_b, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert max_diff(w_a, w_b) < 1e-5 < 1e-4 < max_diff(w_a, weights(tiny_model))


def test_rerun_is_skipped_other_config_refused_unless_force(make_config, tiny_model: Path) -> None:
    _, cfg = make_config(train_toml(lr=0.0))
    write_advantages(cfg.run_dir, make_table(tiny_model, *random_lengths(4)))
    first = run_stage("train", cfg, 0, quiet=True)
    policy = layout.policy_dir(cfg.run_dir, 0) / "model.safetensors"
    mtime = policy.stat().st_mtime_ns
    assert run_stage("train", cfg, 0, quiet=True) == first
    assert policy.stat().st_mtime_ns == mtime
    _, other = make_config(train_toml(lr=1e-2), name="other.toml")
    with pytest.raises(StageError, match="different config"):
        run_stage("train", other, 0, quiet=True)
    forced = run_stage("train", other, 0, force=True, quiet=True)
    assert forced["config"]["train"]["lr"] == 1e-2
    assert max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(tiny_model)) > 1e-3


def test_iteration_starts_from_the_previous_policy(make_config, tiny_model: Path) -> None:
    _, cfg = make_config(train_toml(lr=1e-2))
    table = make_table(tiny_model, *random_lengths(4))
    write_advantages(cfg.run_dir, table, iteration=1)
    with pytest.raises(StageError, match="iter=0000/train"):
        run_stage("train", cfg, 1, quiet=True)
    write_advantages(cfg.run_dir, table, iteration=0)
    run_stage("train", cfg, 0, quiet=True)
    _, zero_lr = make_config(train_toml(lr=0.0), name="zero.toml")
    # iteration 1 continues iteration 0's optimizer: a new lr is refused unless --force
    with pytest.raises(StageError, match=r"train.lr 0.01 -> 0.0 since iteration 0.*--force"):
        run_stage("train", zero_lr, 1, quiet=True)
    m = run_stage("train", zero_lr, 1, force=True, quiet=True)
    assert m["optimizer"]["changed"] == {"lr": [0.01, 0.0]}
    w0, w1 = weights(layout.policy_dir(cfg.run_dir, 0)), weights(layout.policy_dir(cfg.run_dir, 1))
    assert max_diff(w1, w0) == 0.0 < max_diff(w1, weights(tiny_model))


def test_missing_or_bad_advantages_are_named(make_config, tiny_model: Path) -> None:
    # (an empty advantages table is not an error: train takes zero steps, test_train_carry.py)
    _, cfg = make_config()
    with pytest.raises(StageError, match=r"iter=0000/advantages: advantages are missing"):
        run_stage("train", cfg, 0, quiet=True)
    table = make_table(tiny_model, [3, 3], [2, 2])
    bad = table.set_column(4, "behavior_logprobs", pa.array([[-1.0, -1.0], [-1.0]], pa.list_(pa.float32())))
    write_advantages(cfg.run_dir, bad)
    with pytest.raises(StageError, match=r"rollout 0000-p0-1: column 'behavior_logprobs'"):
        run_stage("train", cfg, 0, quiet=True)


def kill_at_a_checkpoint(path: Path, run_dir: str, tmp_path: Path) -> list[dict]:
    """`rlhf-batch train CONFIG --iter 0` in a subprocess, SIGKILLed once it has written a
    checkpoint; returns the metrics that checkpoint holds."""
    ckpt = layout.folder(run_dir, 0, "train") / "checkpoint"
    log = open(tmp_path / "killed.log", "w")  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_batch", "train", str(path), "--iter", "0", "-q"],
        stdout=log,
        stderr=log,
        env=env,
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and not list(ckpt.glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    saved = checkpoint.latest(ckpt)
    assert saved is not None, (tmp_path / "killed.log").read_text()
    assert manifests.manifest(ckpt.parent) is None  # killed before the end
    return json.loads((saved / "state.json").read_text())["metrics"]


def test_resume_after_sigkill_matches_an_uninterrupted_run(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    # 24 rows x 4 tokens, 4 tokens per step, 2 epochs: 48 steps; a checkpoint every 4 steps
    table = make_table(tiny_model, [3] * 24, [4] * 24)
    keys = dict(lr=1e-2, tokens_per_step=4, ppo_epochs=2, checkpoint_every=4)
    path, cfg = make_config(train_toml(**keys))
    write_advantages(cfg.run_dir, table)
    before = kill_at_a_checkpoint(path, cfg.run_dir, tmp_path)

    run_stage("train", cfg, 0, quiet=True)
    rows = metrics(cfg.run_dir).to_pylist()
    assert len(rows) == 48
    assert rows[: len(before)] == before  # resumed: the killed run's rows, timings included
    _, ref = make_config(train_toml(**keys), name="ref.toml", run_dir=str(tmp_path / "ref"))
    write_advantages(ref.run_dir, table)
    run_stage("train", ref, 0, quiet=True)
    assert (
        max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(layout.policy_dir(ref.run_dir, 0)))
        < 1e-6
    )
    # the per-rollout diagnostics: the checkpoint carried the killed run's, so every step's are there
    resumed, uninterrupted = (
        pq.read_table(layout.folder(d, 0, "train") / "rollout_stats.parquet").to_pylist()
        for d in (cfg.run_dir, ref.run_dir)
    )
    assert len(resumed) == 48 and [r["rollout_id"] for r in resumed] == [
        r["rollout_id"] for r in uninterrupted
    ]
    assert [r["step"] for r in resumed] == list(range(48))


def test_gradient_checkpointing_gives_the_same_steps(make_config, tiny_model: Path, tmp_path: Path) -> None:
    table = make_table(tiny_model, *random_lengths(8))
    out = []
    for on in (False, True):
        keys = dict(lr=1e-4, tokens_per_step=12, gradient_checkpointing=on)
        _, cfg = make_config(train_toml(**keys), name=f"{on}.toml", run_dir=str(tmp_path / str(on)))
        write_advantages(cfg.run_dir, table)
        run_stage("train", cfg, 0, quiet=True)
        out.append((metrics(cfg.run_dir).to_pylist(), weights(layout.policy_dir(cfg.run_dir, 0))))
    (rows_off, w_off), (rows_on, w_on) = out
    assert [r["grad_norm"] for r in rows_on] == pytest.approx([r["grad_norm"] for r in rows_off], rel=1e-5)
    assert max_diff(w_on, w_off) < 1e-5 < 1e-4 < max_diff(w_on, weights(tiny_model))
