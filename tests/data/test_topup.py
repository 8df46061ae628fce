"""Dynamic sampling takes further prompts of the run's prompt order: top-up round r of an
iteration takes the next batch after those already taken, the next iteration starts after the
last batch taken, and `sql` / `status` show every round. Real in-process runs of the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.config import load_config
from rlhf_batch.core.prompt_batches import epoch_order
from rlhf_batch.runtime import faults
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests

# 12 prompts, 2 per iteration: 6 batches per epoch. min_groups = 13 is never met (a round adds at
# most 2 groups), so each iteration takes both rounds of the cap: batches 0, 1, 2 for iteration 0
# and 3, 4, 5 for iteration 1 -- together all of epoch 0, each prompt once.
B, G, ROUNDS = 2, 4, 2
SCORE = {"reward_functions": ["tests.commands.test_topup:first_token_parity"], "kl_in_reward": False}
ADVANTAGE = {"min_groups": 13, "max_topup_rounds": ROUNDS}
GENERATE = {"prompts_per_iteration": B, "prompts_per_part": 1}  # 2 parts per round
runner = CliRunner()


def configure(make_config, where: Path, name: str, iterations: int) -> tuple[Path, Any]:
    return make_config(
        name=f"{name}.toml",
        run_dir=str(where / name),
        iterations=iterations,
        in_process=True,
        generate=GENERATE,
        score=SCORE,
        advantage=ADVANTAGE,
        train={"lr": 1e-3},
    )


def round_rows(run_dir: str, it: int, r: int, folder: str = "rollouts") -> list[dict[str, Any]]:
    return pq.read_table(layout.folder(run_dir, it, folder, r)).to_pylist()


def prompt_ids(run_dir: str, it: int, r: int) -> list[str]:
    """The prompts round r of iteration it sampled, in order, each once."""
    return list(dict.fromkeys(row["prompt_id"] for row in round_rows(run_dir, it, r)))


def batch_ids(file_ids: list[str], seed: int, batch: int) -> list[str]:
    """The prompt ids of batch `batch` of the order: positions [j B, (j + 1) B) of epoch
    batch // 6's permutation seeded by (seed, epoch), j = batch mod 6."""
    epoch, j = divmod(batch, 12 // B)
    return [file_ids[row] for row in epoch_order(12, seed, epoch)[j * B : (j + 1) * B]]


def test_topup_rounds_take_the_next_batches_and_the_next_iteration_skips_them(
    make_config, demo_prompts: Path, tmp_path: Path
) -> None:
    path, cfg = configure(make_config, tmp_path, "straight", 2)
    run_pipeline(path, [], quiet=True)
    file_ids = [json.loads(line)["id"] for line in demo_prompts.read_text().splitlines()]
    taken = []
    for it in (0, 1):
        for r in range(ROUNDS + 1):
            batch = it * (ROUNDS + 1) + r  # iteration 1 starts after iteration 0's 3 batches
            assert prompt_ids(cfg.run_dir, it, r) == batch_ids(file_ids, cfg.seed, batch), (it, r)
            m = manifests.manifest(layout.folder(cfg.run_dir, it, "rollouts", r))
            # the manifest records each round's batch, epoch and positions: all in epoch 0 here
            pb = m["prompt_batch"]
            assert (pb["batch"], pb["epoch"], pb["positions"]) == (batch, 0, [batch * B, (batch + 1) * B])
            assert [file_ids[row] for row in pb["rows"]] == prompt_ids(cfg.run_dir, it, r)
            # round r's sample indices are r G .. r G + G - 1
            assert {row["sample_idx"] for row in round_rows(cfg.run_dir, it, r)} == set(
                range(r * G, r * G + G)
            )
            taken += prompt_ids(cfg.run_dir, it, r)
        adv = manifests.manifest(layout.folder(cfg.run_dir, it, "advantages"))
        assert adv["topup_rounds"] == [1, 2] and adv["counts"]["rows_in"] == (ROUNDS + 1) * B * G
    # no prompt sampled twice, in an iteration or across the two: the 6 batches are epoch 0's 12
    assert sorted(taken) == sorted(file_ids)

    # sql: rollouts and scores hold the rows of every round, with their round in `topup`
    def sql(query: str) -> list[list[str]]:
        res = runner.invoke(app, ["sql", "--run-dir", cfg.run_dir, query, "-f", "csv"])
        assert res.exit_code == 0, res.output
        return [line.split(",") for line in res.stdout.splitlines()]

    expected = [["iter", "topup", "n"]] + [[str(it), str(r), str(B * G)] for it in (0, 1) for r in (0, 1, 2)]
    for view in ("rollouts", "scores"):
        assert sql(f"SELECT iter, topup, count(*) AS n FROM {view} GROUP BY ALL ORDER BY ALL") == expected
    joined = sql(
        "SELECT r.iter, r.topup, r.prompt_id, s.reward FROM rollouts r JOIN scores s "
        "USING (iter, topup, rollout_id) WHERE r.iter = 0 AND r.topup = 2 ORDER BY r.rollout_id"
    )
    on_disk = sorted(round_rows(cfg.run_dir, 0, 2, "scores"), key=lambda x: x["rollout_id"])
    assert joined[1:] == [["0", "2", x["prompt_id"], str(x["reward"])] for x in on_disk]
    assert sql(
        "SELECT stage, topup, rows FROM stages WHERE iter = 1 AND stage IN ('rollouts', 'scores') ORDER BY ALL"
    ) == [
        ["stage", "topup", "rows"],
        *[[s, str(r), str(B * G)] for s in ("rollouts", "scores") for r in (0, 1, 2)],
    ]

    # status: one line per round's rollouts and scores, counted, with the batch a round took
    res = runner.invoke(app, ["status", "--run-dir", cfg.run_dir])
    assert res.exit_code == 0, res.output
    lines = {tuple(line.split()[:2]): line.split()[2:] for line in res.stdout.splitlines()[2:]}
    assert lines["1", "topup=02/rollouts"][:2] == ["complete", str(B * G)]
    assert " ".join(lines["1", "topup=02/rollouts"]).endswith("prompt batch 5 (epoch 0, positions 10-12)")
    assert lines["1", "topup=01/scores"][:2] == ["complete", str(B * G)]
    assert " ".join(lines["0", "advantages"]).endswith("with top-up rounds 1, 2")


@pytest.mark.slow
def test_order_is_the_same_after_a_kill_in_a_topup_round_of_an_extended_run(
    make_config, tmp_path: Path
) -> None:
    ref_path, ref = configure(make_config, tmp_path, "ref", 2)
    run_pipeline(ref_path, [], quiet=True)
    # a run of 1 iteration, extended to 2; iteration 1's round 1 killed after its first part
    path, cfg = configure(make_config, tmp_path, "killed", 1)
    run_pipeline(path, [], quiet=True)
    longer = load_config(path, ["iterations=2"])
    run_stage("generate", longer, 1, quiet=True)
    run_stage("score", longer, 1, quiet=True)
    env = {
        **os.environ,
        faults.FAULT_ENV: "rollouts:part-0:done",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    cmd = [
        sys.executable,
        "-m",
        "rlhf_batch",
        "generate",
        str(path),
        "--iter",
        "1",
        "--topup",
        "1",
        "--quiet",
    ]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    round1 = layout.folder(cfg.run_dir, 1, "rollouts", 1)
    assert killed.returncode == -9, killed.stderr  # SIGKILL at the fault point
    assert [p.name for p in layout.list_parts(round1)] == [layout.part_name(0, 0)]
    assert manifests.manifest(round1) is None
    run_pipeline(path, ["iterations=2"], quiet=True)
    for it in (0, 1):
        for r in range(ROUNDS + 1):
            for folder in ("rollouts", "scores"):
                a = pq.read_table(layout.folder(cfg.run_dir, it, folder, r)).drop_columns(
                    ["policy"] if folder == "rollouts" else []
                )
                b = pq.read_table(layout.folder(ref.run_dir, it, folder, r)).drop_columns(
                    ["policy"] if folder == "rollouts" else []
                )
                assert a.equals(b), (it, r, folder)
            pa_, pb = (
                manifests.manifest(layout.folder(d, it, "rollouts", r))["prompt_batch"]
                for d in (cfg.run_dir, ref.run_dir)
            )
            assert pa_ == pb
    # a top-up round of iteration 0 now would take prompts iteration 1 went on from: refused
    res = runner.invoke(app, ["generate", str(path), "--iter", "0", "--topup", "3"])
    assert res.exit_code == 1 and "iteration 1 has started" in str(res.exception)
