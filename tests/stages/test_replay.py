"""advantage.replay: stored training rows of earlier iterations join an iteration's advantages,
chosen by a predicate over the scored rollouts, at most a share of the rows, recorded in the
manifest, and read by train. Real in-process runs of the tiny model; the expected rows are
worked out from the Parquet files with plain Python."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.config import STALE_TIS_CAP, load_config
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.runtime import faults
from rlhf_batch.store import layout, manifests

SCORE = {"reward_functions": ["tests.commands.test_topup:first_token_parity"], "kl_in_reward": False}
REPLAY = {
    "iterations": 2,
    "where": "score > 0.5 AND finish_reason = 'stop' OR sample_idx = 0",
    "max_share": 0.25,
}


def configure(
    make_config, tmp_path: Path, name: str, iterations: int, replay: dict | None = None
) -> tuple[Path, Any]:
    return make_config(
        name=f"{name}.toml",
        run_dir=str(tmp_path / name),
        iterations=iterations,
        in_process=True,
        score=SCORE,
        advantage={"rows_per_part": 8, **({"replay": replay} if replay else {})},
        train={"lr": 1e-3},
    )


def rows(run_dir: str, it: int, folder: str) -> list[dict[str, Any]]:
    return pq.read_table(layout.folder(run_dir, it, folder)).to_pylist()


def test_the_cap_keeps_the_replayed_share_at_most_f() -> None:
    from rlhf_batch.stages.replay import cap

    # f = 1/4, 12 own rows: 4 replayed are 4/16 = 1/4 exactly; 5 would be 5/17 > 1/4
    assert cap(12, 0.25) == 4
    # f = 0.3 (3/10), 10 own rows: 3 x 10 / 7 = 4.29 -> 4 (4/14 = 0.286; 5/15 = 0.333 > 0.3)
    assert cap(10, 0.3) == 4
    # f = 0.2 (1/5, not the binary double just above it), 4 own rows: 4 / 4 = 1 exactly -> 1
    assert cap(4, 0.2) == 1 and cap(0, 0.5) == 0


@pytest.mark.slow
def test_replayed_rows_are_the_stored_rows_that_match_capped_and_recorded(make_config, tmp_path) -> None:
    path, cfg = configure(make_config, tmp_path, "replay", 3, REPLAY)
    assert cfg.train.recompute_old is True and cfg.train.tis_cap == STALE_TIS_CAP  # stale rows: decoupled
    run_pipeline(path, [], quiet=True)
    for it in (1, 2):
        m = manifests.manifest(layout.folder(cfg.run_dir, it, "advantages"))
        adv = rows(cfg.run_dir, it, "advantages")
        own = [r for r in adv if r["rollout_id"].startswith(f"{it:04d}-")]
        replayed = [r for r in adv if not r["rollout_id"].startswith(f"{it:04d}-")]
        assert len(own) == m["counts"]["rows_out"] and len(replayed) == m["counts"]["rows_replayed"]
        # own rows first (parts 0 .. ceil(own / 8) - 1), then the replay parts
        assert adv[: len(own)] == own
        # candidates: each source iteration's own advantage rows whose scored rollout matches
        cand = {}
        for j in range(max(0, it - 2), it):
            scored = {r["rollout_id"]: r for r in rows(cfg.run_dir, j, "rollouts")}
            for s in rows(cfg.run_dir, j, "scores"):
                scored[s["rollout_id"]]["score"] = s["score"]
            for r in rows(cfg.run_dir, j, "advantages"):
                x = scored.get(r["rollout_id"])
                if x and ((x["score"] > 0.5 and x["finish_reason"] == "stop") or x["sample_idx"] == 0):
                    cand[r["rollout_id"]] = r  # as stored at iteration j
        cap = math.floor(0.25 * len(own) / 0.75)  # replayed / (own + replayed) <= 1/4
        rec = m["replay"]
        assert rec["candidates"] == len(cand) and rec["max_rows"] == cap
        assert len(replayed) == min(cap, len(cand)) > 0
        assert len(replayed) / len(adv) <= 0.25
        assert all(r == cand[r["rollout_id"]] for r in replayed)  # advantage, log-probs, ... as stored
        listed = {rid for src in rec["from"].values() for rid in src["rollout_ids"]}
        assert listed == {r["rollout_id"] for r in replayed}
        for j, src in rec["from"].items():
            assert src["staleness"] == it - int(j)  # lock-step: the iteration difference
            assert all(rid.startswith(f"{int(j):04d}-") for rid in src["rollout_ids"])
        # train read them: its per-rollout diagnostics cover the replayed rows
        stats = {
            r["rollout_id"]
            for r in pq.read_table(
                layout.folder(cfg.run_dir, it, "train") / "rollout_stats.parquet"
            ).to_pylist()
        }
        assert {r["rollout_id"] for r in replayed} <= stats
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages"))["replay"]["rows"] == 0


@pytest.mark.slow
def test_replay_settings_are_checked_and_off_leaves_no_trace(make_config, tmp_path) -> None:
    path, cfg = configure(make_config, tmp_path, "bad", 1)
    assert cfg.train.recompute_old is False and cfg.train.tis_cap == 0.0
    for value, words in [
        ("{iterations = 0, max_share = 0.2}", "iterations = W >= 1"),
        ("{iterations = 1, max_share = 1.0}", "0 < f < 1"),
        ("{iterations = 1, max_share = 0.2, were = 'x'}", "no key 'were'"),
        ("{iterations = 1, max_share = 0.2, where = 'score >'}", "where"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(path, [f"advantage.replay={value}"])
        assert "advantage.replay" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
    run_pipeline(path, [], quiet=True)
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages"))
    assert "replay" not in m and "replay" not in m["inputs"] and "rows_replayed" not in m["counts"]
    # a column the scored rollouts do not have: one line naming the option, nothing written
    from rlhf_batch.stages.registry import run_stage

    bad = load_config(path, ["advantage.replay={iterations = 1, max_share = 0.5, where = 'nope > 1'}"])
    run_stage("generate", bad, 1, quiet=True)
    run_stage("score", bad, 1, quiet=True)
    with pytest.raises(StageError) as e:
        run_stage("advantage", bad, 1, quiet=True)
    assert str(e.value).startswith("advantage.replay.where:") and "nope" in str(e.value)
    assert not layout.folder(cfg.run_dir, 1, "advantages").exists()


@pytest.mark.slow
def test_a_killed_replay_advantage_resumes_to_the_same_parts(make_config, tmp_path) -> None:
    ref_path, ref = configure(make_config, tmp_path, "ref", 2, REPLAY)
    run_pipeline(ref_path, [], quiet=True)
    path, cfg = configure(make_config, tmp_path, "killed", 2, REPLAY)
    run_pipeline(path, ["iterations=1"], quiet=True)
    from rlhf_batch.stages.registry import run_stage

    run_stage("generate", cfg, 1, quiet=True)
    run_stage("score", cfg, 1, quiet=True)
    m_ref = manifests.manifest(layout.folder(ref.run_dir, 1, "advantages"))
    own_parts = math.ceil(m_ref["counts"]["rows_out"] / 8)
    assert len(m_ref["parts"]) > own_parts  # a replay part exists
    env = {**os.environ, faults.FAULT_ENV: f"advantages:part-{own_parts - 1}:done"}
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    cmd = [sys.executable, "-m", "rlhf_batch", "advantage", str(path), "--iter", "1", "--quiet"]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr  # killed after the own parts, before the replay part
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "advantages")) is None
    run_pipeline(path, [], quiet=True)
    for folder in ("advantages",):
        a, b = (pq.read_table(layout.folder(d, 1, folder)) for d in (cfg.run_dir, ref.run_dir))
        assert a.equals(b)
    m = manifests.manifest(layout.folder(cfg.run_dir, 1, "advantages"))
    assert m["replay"] == m_ref["replay"] and [p["rows"] for p in m["parts"]] == [
        p["rows"] for p in m_ref["parts"]
    ]


@pytest.mark.slow  # an S3 server's round trips, a teacher and two iterations of score and advantage
def test_replayed_opd_rows_keep_their_token_advantages_on_s3(make_config, tmp_path, s3_run) -> None:
    """opd on an S3 run dir (a real S3-protocol server): a replayed row is the stored row of its
    iteration, its `token_advantages` included (teacher - behaviour log-probs of the policy that
    sampled it, as a stale rollout's: the decoupled objective corrects for that policy). Two
    iterations of 3 prompts x 4 written rollouts: opd keeps every group, so 12 own rows and a cap
    of floor(0.25 x 12 / 0.75) = 4 of iteration 0's 12 rows. A source iteration written by
    another estimator has no token advantages: refused in one line, nothing written."""
    from rlhf_batch.models.tiny import init_model
    from rlhf_batch.stages.registry import run_stage
    from rlhf_batch.store.schemas import ADVANTAGES, TOKEN_ADVANTAGES, with_extra
    from tests.stages.test_score import write_rollouts

    teacher = init_model(tmp_path / "teacher", arch="qwen2", seed=5)
    adv = {"estimator": "opd", "rows_per_part": 8, "replay": {"iterations": 1, "max_share": 0.25}}
    _, cfg = make_config(run_dir=s3_run, score={"teacher_model": str(teacher)}, advantage=adv)
    for it in (0, 1):
        write_rollouts(cfg, it, delta=0.01 * it)
        run_stage("score", cfg, it, quiet=True)
        m = run_stage("advantage", cfg, it, quiet=True)
    schema = with_extra(ADVANTAGES, TOKEN_ADVANTAGES)

    def table(it: int) -> list[dict[str, Any]]:
        return manifests.read_complete(layout.folder(cfg.run_dir, it, "advantages"), schema).to_pylist()

    stored = {r["rollout_id"]: r for r in table(0)}
    rows = table(1)
    replayed = [r for r in rows if r["rollout_id"].startswith("0000-")]
    assert len(rows) == 16 and len(replayed) == m["counts"]["rows_replayed"] == 4
    assert m["replay"]["candidates"] == 12 and m["replay"]["max_rows"] == 4
    assert all(r == stored[r["rollout_id"]] for r in replayed)  # token_advantages as stored
    assert all(len(r["token_advantages"]) == len(r["input_ids"]) - r["prompt_len"] for r in replayed)

    _, grpo = make_config(run_dir=s3_run, advantage={"rows_per_part": 8}, name="grpo.toml")
    run_stage("advantage", grpo, 0, force=True, quiet=True)  # iteration 0 re-done by grpo
    with pytest.raises(StageError) as e:
        run_stage("advantage", cfg, 1, force=True, quiet=True)
    assert str(e.value).startswith(
        "advantage.replay: "
    ) and "iter=0000/advantages has no token_advantages" in str(e.value)
    assert "\n" not in str(e.value)
    assert table(1) == rows  # the old output is kept


def _with_loss_mask(cfg: Any, it: int) -> None:
    """iter=`it`/rollouts rewritten with a multi-turn `loss_mask`: the last response token of
    every odd sample is not the policy's (an environment's)."""
    import pyarrow as pa

    from rlhf_batch.store import output
    from rlhf_batch.store.schemas import LOSS_MASK, with_extra

    sdir = layout.folder(cfg.run_dir, it, "rollouts")
    t = pq.read_table(sdir)
    masks = [
        [1] * (len(ids) - 1) + [1 - s % 2]
        for ids, s in zip(t["response_ids"].to_pylist(), t["sample_idx"].to_pylist(), strict=True)
    ]
    t = t.append_column(LOSS_MASK.field("loss_mask"), pa.array(masks, LOSS_MASK.field("loss_mask").type))
    schema = with_extra(
        with_extra(pa.schema([f for f in t.schema if f.name != "loss_mask"]), LOSS_MASK), t.schema
    )
    stage = output.claim(sdir, "rollouts", {"test": True}, {}, True)
    stage.write_table(0, t.select(schema.names), schema)
    stage.finish(1)


def test_replayed_multi_turn_rows_keep_their_loss_mask(make_config, tmp_path) -> None:
    """Rows whose rollouts carry a loss_mask (multi-turn) keep it when replayed: train must not
    learn the environment's tokens of a replayed row either. 12 own rows (letter_count varies in
    every group of write_rollouts' responses), a cap of floor(0.25 x 12 / 0.75) = 4."""
    from rlhf_batch.stages.registry import run_stage
    from tests.stages.test_score import write_rollouts

    adv = {"rows_per_part": 8, "replay": {"iterations": 1, "max_share": 0.25}}
    _, cfg = make_config(score={"kl_in_reward": False}, advantage=adv)
    for it in (0, 1):
        write_rollouts(cfg, it)
        _with_loss_mask(cfg, it)
        run_stage("score", cfg, it, quiet=True)
        m = run_stage("advantage", cfg, it, quiet=True)
    stored = {r["rollout_id"]: r for r in rows(cfg.run_dir, 0, "advantages")}
    assert all("loss_mask" in r for r in stored.values())
    replayed = [r for r in rows(cfg.run_dir, 1, "advantages") if r["rollout_id"].startswith("0000-")]
    assert len(replayed) == m["counts"]["rows_replayed"] == 4
    assert all(r == stored[r["rollout_id"]] for r in replayed)  # loss_mask included
    assert any(0 in r["loss_mask"] for r in stored.values())
