"""train on SFT and DPO iterations (train.objective): what the loss receives, checked on the first
step's loss against numbers worked out from the advantages file (before the first update the
policy's log-probs are the behaviour log-probs `make_table` stores), the pairs kept together, the
reference log-probs read from the rows, and a resume after SIGKILL equal to an uninterrupted run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from rlhf_batch.data.selection import PAIRS
from rlhf_batch.errors import StageError
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train import step as train_step
from rlhf_batch.store import layout, manifests, output
from rlhf_batch.store.schemas import ADVANTAGES, LOSS_MASK, with_extra
from tests.stages.test_train import kill_at_a_checkpoint, make_table, max_diff, metrics, weights

SFT = {"objective": "sft", "lr": 1e-2, "tokens_per_step": 10_000}
SELECT = {"advantage": {"select": {"best": 1}}}


def write(run_dir: str, table: pa.Table, objective: str, it: int = 0) -> None:
    """`table` as iteration `it`'s advantages, written for `objective` (with loss_mask / pair columns)."""
    schema = ADVANTAGES
    if "loss_mask" in table.column_names:
        schema = with_extra(schema, LOSS_MASK)
    if "pair" in table.column_names:
        schema = with_extra(schema, PAIRS)
    extra = {} if objective == "grpo" else {"objective": objective}
    stage = output.claim(layout.folder(run_dir, it, "advantages"), "advantage", {"test": True}, {})
    stage.write_table(0, table.select(schema.names), schema)
    stage.finish(1, extra)


def masked(table: pa.Table, masks: list[list[int]]) -> pa.Table:
    return table.append_column("loss_mask", pa.array(masks, pa.list_(pa.int8())))


def test_sft_step_loss_is_the_cross_entropy_of_the_sampled_tokens(make_config, tiny_model: Path) -> None:
    # 3 rows of 4 response tokens; rows 1 and 2 hold environment tokens (loss_mask 0)
    masks = [[1, 1, 1, 1], [1, 0, 0, 1], [0, 1, 1, 1]]
    table = masked(make_table(tiny_model, [3, 2, 4], [4, 4, 4]), masks)
    _, cfg = make_config(train=SFT, **SELECT)
    write(cfg.run_dir, table, "sft")
    run_stage("train", cfg, 0, quiet=True)
    old = table.column("behavior_logprobs").to_pylist()
    sampled = [lp for row, m in zip(old, masks, strict=True) for lp, k in zip(row, m, strict=True) if k]
    # -(sum of the 9 sampled tokens' log-probs) / 9; the environment's 3 tokens are left out
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["loss"] == pytest.approx(-sum(sampled) / len(sampled), rel=1e-5)
    assert row["tokens"] == 9 and row["clip_fraction"] == 0.0
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "train"))
    assert m["objective"] == "sft"
    # advantage 0 everywhere changes nothing for GRPO; SFT trains on the rows whatever their advantage
    zero = table.set_column(6, "advantage", pa.array([0.0] * 3, pa.float32()))
    _, again = make_config(train=SFT, run_dir=cfg.run_dir + "-zero", **SELECT)
    write(again.run_dir, zero, "sft")
    run_stage("train", again, 0, quiet=True)
    assert (
        max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(layout.policy_dir(again.run_dir, 0)))
        == 0
    )
    assert max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(tiny_model)) > 1e-4


def pair_table(tiny_model: Path) -> tuple[pa.Table, list[float], list[int]]:
    """4 rows, 2 pairs written out of order (pair 1's rejected row first); the reference
    log-probs are the behaviour ones shifted by `shift` per sampled token; row 2 has 2
    environment tokens."""
    table = make_table(tiny_model, [3, 3, 2, 4], [3, 4, 5, 2])
    shift = [0.5, -0.25, 0.1, -0.3]
    masks = [[1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 1, 1], [1, 1]]
    ref = [
        [lp + s if k else 0.0 for lp, k in zip(row, m, strict=True)]
        for row, s, m in zip(table.column("behavior_logprobs").to_pylist(), shift, masks, strict=True)
    ]
    table = table.set_column(5, "ref_logprobs", pa.array(ref, pa.list_(pa.float32())))
    table = masked(table, masks)
    table = table.append_column("pair", pa.array([1, 0, 1, 0], pa.int32()))
    table = table.append_column("chosen", pa.array([False, True, True, False]))
    return table, shift, [sum(m) for m in masks]


@pytest.mark.parametrize(("loss", "beta"), [("sigmoid", 0.1), ("ipo", 0.5)])
def test_dpo_step_loss_from_the_stored_reference_log_probs(
    make_config, tiny_model: Path, loss: str, beta: float
) -> None:
    table, shift, n = pair_table(tiny_model)
    _, cfg = make_config(
        train={"objective": "dpo", "dpo_loss": loss, "dpo_beta": beta, "tokens_per_step": 10_000}
    )
    write(cfg.run_dir, table, "dpo")
    run_stage("train", cfg, 0, quiet=True)
    # pi - ref over a row's sampled tokens = -shift x its sampled tokens n (pi = behaviour at step 0)
    ratio = [-s * k for s, k in zip(shift, n, strict=True)]
    # pair 0: chosen row 1, rejected row 3; pair 1: chosen row 2, rejected row 0
    pairs = [(1, 3), (2, 0)]
    if loss == "sigmoid":  # -log sigmoid(beta (ratio_c - ratio_r))
        want = [math.log1p(math.exp(-beta * (ratio[c] - ratio[r]))) for c, r in pairs]
    else:  # (ratio_c / n_c - ratio_r / n_r - 1 / (2 beta))^2
        want = [(ratio[c] / n[c] - ratio[r] / n[r] - 1 / (2 * beta)) ** 2 for c, r in pairs]
    # pair 0: ratio_c = 0.25 x 4 = 1, ratio_r = 0.3 x 2 = 0.6; pair 1: -0.1 x 3 = -0.3, -0.5 x 3 = -1.5
    assert ratio == pytest.approx([-1.5, 1.0, -0.3, 0.6])
    row = metrics(cfg.run_dir).to_pylist()[0]
    assert row["loss"] == pytest.approx(sum(want) / 2, rel=1e-5)
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "train"))
    assert m["objective"] == "dpo" and m["counts"]["pairs"] == 2


def test_a_pairs_two_rows_share_every_micro_batch(make_config, tiny_model: Path, monkeypatch) -> None:
    table, _, _ = pair_table(tiny_model)
    # micro-batches of at most 2 x 8 tokens: one pair each; 2 epochs
    keys = {"objective": "dpo", "tokens_per_step": 10_000, "max_tokens_per_batch": 16, "ppo_epochs": 2}
    _, cfg = make_config(train=keys)
    write(cfg.run_dir, table, "dpo")
    seen: list[list[str]] = []
    real = train_step.micro_batch

    def micro_batch(data: Any, rows: Any, device: Any) -> Any:
        seen.append(
            [f"{int(table['pair'][i].as_py())}{'c' if table['chosen'][i].as_py() else 'r'}" for i in rows]
        )
        return real(data, rows, device)

    monkeypatch.setattr(train_step, "micro_batch", micro_batch)
    run_stage("train", cfg, 0, quiet=True)
    assert sorted(map(tuple, seen)) == [("0c", "0r"), ("0c", "0r"), ("1c", "1r"), ("1c", "1r")]


def test_dpo_without_reference_log_probs_or_on_other_rows_is_refused(make_config, tiny_model: Path) -> None:
    table, _, _ = pair_table(tiny_model)
    no_ref = table.set_column(5, "ref_logprobs", pa.nulls(4, pa.list_(pa.float32())))
    _, cfg = make_config(train={"objective": "dpo"})
    write(cfg.run_dir, no_ref, "dpo")
    with pytest.raises(StageError, match=r"'dpo' needs the reference log-probs \(ref_logprobs\)"):
        run_stage("train", cfg, 0, quiet=True)
    _, other = make_config(train={"objective": "dpo"}, run_dir=cfg.run_dir + "-grpo")
    write(other.run_dir, make_table(tiny_model, [3] * 4, [3] * 4), "grpo")
    with pytest.raises(
        StageError, match=r"written for objective 'grpo', train.objective gives iteration 0 'dpo'"
    ):
        run_stage("train", other, 0, quiet=True)
    assert manifests.manifest(layout.folder(other.run_dir, 0, "train")) is None


def test_dpo_resume_after_sigkill_matches_an_uninterrupted_run(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    # 12 pairs of 4-token rows, one pair a step, 2 epochs: 24 steps, a checkpoint every 3
    table = make_table(tiny_model, [3] * 24, [4] * 24)
    rng = np.random.default_rng(0)
    ref = [
        (np.array(r) + rng.normal(0, 0.3, 4)).tolist() for r in table.column("behavior_logprobs").to_pylist()
    ]
    table = table.set_column(5, "ref_logprobs", pa.array(ref, pa.list_(pa.float32())))
    table = table.append_column("pair", pa.array([i // 2 for i in range(24)], pa.int32()))
    table = table.append_column("chosen", pa.array([i % 2 == 0 for i in range(24)]))
    keys = {"objective": "dpo", "lr": 1e-2, "tokens_per_step": 8, "ppo_epochs": 2, "checkpoint_every": 3}
    path, cfg = make_config(train=keys)
    write(cfg.run_dir, table, "dpo")
    before = kill_at_a_checkpoint(path, cfg.run_dir, tmp_path)
    run_stage("train", cfg, 0, quiet=True)
    rows = metrics(cfg.run_dir).to_pylist()
    assert len(rows) == 24 and rows[: len(before)] == before
    _, ref_cfg = make_config(train=keys, name="ref.toml", run_dir=str(tmp_path / "ref"))
    write(ref_cfg.run_dir, table, "dpo")
    run_stage("train", ref_cfg, 0, quiet=True)
    assert (
        max_diff(weights(layout.policy_dir(cfg.run_dir, 0)), weights(layout.policy_dir(ref_cfg.run_dir, 0)))
        < 1e-6
    )
    assert [r["loss"] for r in rows] == pytest.approx(
        [r["loss"] for r in metrics(ref_cfg.run_dir).to_pylist()]
    )
