"""train checked against hand-worked losses: the advantages table of a real run (generate ->
score -> advantage at temperature 0.7) is edited on disk so that each row has a chosen
advantage A and behaviour log-probs shifted by a chosen s. Train's first forward gives the
sampling policy's own log-probs (to float32 rounding), so every token of the row has the ratio
r = exp(logp - (logp + s)) = exp(-s) and the same per-token loss, worked out by hand below."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.stages.cli_helpers import (
    manifest,
    part_files,
    read,
    rewrite,
    small_prompts,
    stage,
    unpadded_logprobs,
)

T = 0.7
E = math.e
# (A, s) per row, cycling; eps_low = eps_high = 0.2, loss_tok = -min(r A, clip(r, 0.8, 1.2) A),
# with dual clip c = 1.5 for A < 0: min(loss_tok, -c A)
COMBOS = [
    # A,   s,    loss_tok without dual clip,        with dual clip 1.5
    (1.0, -0.5, -1.2, -1.2),  # r = e^0.5 = 1.6487213 > 1.2: clipped, -1.2
    (-1.0, -0.5, E**0.5, 1.5),  # r = 1.6487213: -min(-1.6487, -1.2) = 1.6487213; dual: 1.5
    (1.0, 0.5, -(E**-0.5), -(E**-0.5)),  # r = e^-0.5 = 0.6065307: -min(0.6065, 0.8) = -0.6065307
    (-1.0, 0.5, 0.8, 0.8),  # r = 0.6065307: -min(-0.6065, -0.8) = 0.8 (below the dual bound 1.5)
    (-2.0, -1.0, 2 * E, 3.0),  # r = e = 2.7182818: -min(-5.4365637, -2.4) = 5.4365637; dual: 2 * 1.5 = 3
    (0.5, 0.0, -0.5, -0.5),  # r = 1: -0.5
]


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return small_prompts(tmp_path)  # 16 rollouts of up to 6 tokens


def base_run(make_config, prompts: Path, **train: object) -> tuple[Path, object, list[int], list[int]]:  # noqa: ANN001
    """generate -> score -> advantage, then row i of the advantages gets COMBOS[i % 6]'s A and
    s. Returns (config path, config, combo index per row, response length per row)."""
    path, cfg = make_config(
        generate={"temperature": T, "prompts": str(prompts)},
        advantage={"drop_zero_variance": False},
        train={"lr": 0.0, **train},
    )
    for name in ("generate", "score", "advantage"):
        stage(path, name)
    combos, lengths, i = [], [], 0
    for part in part_files(cfg.run_dir, "advantages"):
        t = pq.read_table(part)
        n = t.num_rows
        k = [(i + j) % len(COMBOS) for j in range(n)]
        beh = [
            [x + COMBOS[c][1] for x in row]
            for row, c in zip(t["behavior_logprobs"].to_pylist(), k, strict=True)
        ]
        t = t.set_column(t.schema.get_field_index("behavior_logprobs"), "behavior_logprobs", pa.array(beh))
        t = t.set_column(
            t.schema.get_field_index("advantage"), "advantage", pa.array([COMBOS[c][0] for c in k])
        )
        rewrite(part, t)
        combos += k
        lengths += [len(row) for row in beh]
        i += n
    assert len(combos) == 16 and min(lengths) >= 1  # 4 prompts x 4 samples
    return path, cfg, combos, lengths


def metrics(cfg) -> list[dict]:  # noqa: ANN001
    return pq.read_table(Path(cfg.run_dir) / "iter=0000" / "train" / "metrics.parquet").to_pylist()


CASES = [  # aggregation, dual_clip, norm_const, the norm_const used (0: generate.max_new_tokens = 6)
    ("token_mean", 0.0, 0.0, None),
    ("token_mean", 1.5, 0.0, None),
    ("seq_mean_token_mean", 1.5, 0.0, None),
    ("seq_mean_token_sum_norm", 1.5, 3.0, 3.0),
    ("seq_mean_token_sum_norm", 0.0, 0.0, 6.0),
]


def test_first_step_loss_by_hand_dual_clip_aggregations_and_norm_const(make_config, prompts: Path) -> None:
    path, cfg, combos, lengths = base_run(make_config, prompts)
    tokens, rows = sum(lengths), len(lengths)
    for aggregation, dual, norm, divisor in CASES:
        case = (aggregation, dual, norm)
        sets = [f"train.aggregation='{aggregation}'", f"train.dual_clip={dual}", f"train.norm_const={norm}"]
        stage(path, "train", *sets, force=True)
        m = metrics(cfg)[0]
        assert (m["sequences"], m["tokens"]) == (rows, tokens), case  # one step holds every row
        loss = [COMBOS[c][3 if dual else 2] for c in combos]  # loss_tok of each row
        if aggregation == "token_mean":  # sum over rows of loss_tok * length / total tokens
            want = sum(x * n for x, n in zip(loss, lengths, strict=True)) / tokens
        elif aggregation == "seq_mean_token_mean":  # mean over rows of the row's token mean: loss_tok
            want = sum(loss) / rows
        else:  # mean over rows of token sum / norm_const = loss_tok * length / norm_const
            want = sum(x * n / divisor for x, n in zip(loss, lengths, strict=True)) / rows
        assert m["loss_objective"] == pytest.approx(want, abs=1e-4), case
    # the dual clip changes the hand-worked value: rows of combos 1 and 4 lose 0.1487 and 2.4366 per token
    assert sum((COMBOS[c][2] - COMBOS[c][3]) * n for c, n in zip(combos, lengths, strict=True)) / tokens > 0.1


def test_recompute_old_covers_every_step_of_the_first_epoch(make_config, prompts: Path) -> None:
    # ~24 tokens per step: several optimizer steps; lr 0, so the policy never moves
    path, cfg, _, _ = base_run(make_config, prompts, tokens_per_step=24, ppo_epochs=2)
    stage(path, "train", "train.recompute_old=false", force=True)
    steps = metrics(cfg)
    assert len(steps) >= 6 and {s["epoch"] for s in steps} == {0, 1}
    # stored (shifted) behaviour log-probs: every step sees ratios exp(-s) != 1
    assert min(s["kl_approx"] for s in steps) > 1e-3
    stage(path, "train", "train.recompute_old=true", force=True)
    steps = metrics(cfg)
    # recomputed with the unchanged policy: every ratio is 1 in every step of both epochs
    for s in steps:
        assert abs(s["ratio_mean"] - 1.0) < 1e-5 and s["kl_approx"] < 1e-8, s


def test_one_step_raises_positive_advantage_tokens_and_lowers_negative_ones(
    make_config, tiny_model: Path, prompts: Path
) -> None:
    """One optimizer step (no shift: ratio 1, A = +1 / -1 by row): gradient descent on
    -mean(A r) must move log-probs up where A > 0 and down where A < 0."""
    from transformers import AutoModelForCausalLM

    path, cfg = make_config(
        generate={"temperature": T, "prompts": str(prompts)},
        advantage={"drop_zero_variance": False},
        train={"lr": 1e-3},
    )
    for name in ("generate", "score", "advantage"):
        stage(path, name)
    for part in part_files(cfg.run_dir, "advantages"):
        t = pq.read_table(part)
        adv = [1.0 if j % 2 == 0 else -1.0 for j in range(t.num_rows)]
        rewrite(part, t.set_column(t.schema.get_field_index("advantage"), "advantage", pa.array(adv)))
    stage(path, "train")
    assert manifest(cfg.run_dir, "train")["counts"]["steps"] == 1
    before = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    policy = Path(cfg.run_dir) / "iter=0000" / "train" / manifest(cfg.run_dir, "train")["policy"]
    after = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
    up, down, objective = [], [], 0.0
    for r in read(cfg.run_dir, "advantages").to_pylist():
        p, ids = r["prompt_len"], r["input_ids"]
        delta = unpadded_logprobs(after, ids[:p], ids[p:], T) - unpadded_logprobs(before, ids[:p], ids[p:], T)
        (up if r["advantage"] > 0 else down).append(delta)
        objective += r["advantage"] * float(delta.sum())
    mean_up, mean_down = float(torch.cat(up).mean()), float(torch.cat(down).mean())
    assert mean_up > 0 > mean_down, (mean_up, mean_down)
    assert objective > 0
