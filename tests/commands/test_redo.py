"""`rlhf-batch run CONFIG --redo-from K[:STAGE]`: after a reward fix, the stage and everything
downstream are redone in one command; a kill in the middle is finished by `run`; `status` shows
what is still to redo as stale. Real runs of the tiny model: a first run in process, the redo in
a subprocess (as a user runs it), with the reward "fixed" through the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.runtime import faults
from rlhf_batch.store import layout, manifests, redo

ROOT = Path(__file__).resolve().parents[2]
FIX = "RLHF_BATCH_TEST_REWARD_FIX"
STAGES = [(0, "rollouts"), (0, "scores"), (0, "advantages"), (0, "train")]
STAGES += [(1, "rollouts"), (1, "scores"), (1, "advantages"), (1, "train")]


def reward(*, responses: list[str], **_: Any) -> list[float]:
    """The length's parity; "fixed" (FIX set): whether the length is a multiple of 3."""
    if os.environ.get(FIX):
        return [float(len(r) % 3 == 0) for r in responses]
    return [float(len(r) % 2) for r in responses]


def configure(make_config, where: Path, name: str) -> tuple[Path, Any]:  # noqa: ANN001
    return make_config(
        name=f"{name}.toml",
        run_dir=str(where / name),
        iterations=2,
        in_process=True,
        score={"reward_functions": ["tests.commands.test_redo:reward"]},
        train={"lr": 1e-3},
    )


def manifests_of(run_dir: str) -> dict[tuple[int, str], dict]:
    return {(it, f): manifests.manifest(layout.folder(run_dir, it, f)) for it, f in STAGES}


def cli(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, FIX: "1", "PYTHONPATH": str(ROOT)}
    if fault:
        env[faults.FAULT_ENV] = fault
    cmd = [sys.executable, "-m", "rlhf_batch", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def status(run_dir: str) -> dict[tuple[str, str], str]:
    """(iteration, stage) -> the state `status` prints."""
    out = cli("status", "--run-dir", run_dir)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:] if line[:1] == " " or line[:1].isdigit()]
    return {(r[0], r[1]): r[2] for r in rows if len(r) > 2 and r[0].isdigit()}


def table(run_dir: str, it: int, folder: str) -> pa.Table:
    """A stage's rows read back with pyarrow: its parts in manifest order (train: its metrics,
    less the timing)."""
    sdir = layout.folder(run_dir, it, folder)
    if folder == "train":
        return pq.read_table(sdir / layout.METRICS_FILE).drop_columns(["tokens_per_s"])
    t = pa.concat_tables(pq.read_table(sdir / p["file"]) for p in manifests.manifest(sdir)["parts"])
    return t.drop_columns(["policy"] if folder == "rollouts" else [])  # the policy's path


@pytest.mark.slow
def test_redo_from_score_redoes_exactly_the_downstream_stages_and_a_kill_resumes(
    make_config, tmp_path: Path
) -> None:
    path, cfg = configure(make_config, tmp_path, "whole")
    killed_path, killed = configure(make_config, tmp_path, "killed")
    for p in (path, killed_path):
        run_pipeline(p, [], quiet=True)
    before, killed_before = manifests_of(cfg.run_dir), manifests_of(killed.run_dir)
    assert status(cfg.run_dir) == {(str(it), f): "complete" for it, f in STAGES}

    # a stage forced by hand: `run` refuses what follows, and status says so up to the end
    done = cli("score", str(path), "--iter", "0", "--force", "--quiet")
    assert done.returncode == 0, done.stderr
    shown = status(cfg.run_dir)
    assert shown[("0", "rollouts")] == shown[("0", "scores")] == "complete"
    assert all(shown[(str(it), f)] == "stale" for it, f in STAGES[2:]), shown  # iteration 1 too
    refused = cli("run", str(path), "--quiet")
    assert refused.returncode != 0 and "--redo-from 0:advantage" in refused.stderr
    forced = manifests.manifest(layout.folder(cfg.run_dir, 0, "scores"))

    # the one command: the fixed scores of iteration 0 and everything after them
    out = cli("run", str(path), "--quiet", "--redo-from", "0:score")
    assert out.returncode == 0, out.stderr
    after = manifests_of(cfg.run_dir)
    assert after[(0, "rollouts")] == before[(0, "rollouts")]  # upstream: untouched
    # score 0 gives what the forced one gave: that folder stays (staging.same_output)
    assert after[(0, "scores")] == forced
    tokens = {after[s].get("redo") for s in STAGES[2:]}
    assert len(tokens) == 1 and None not in tokens  # each downstream stage redone under one mark
    assert redo.read(cfg.run_dir) is None  # finished: the mark is gone
    assert set(status(cfg.run_dir).values()) == {"complete"}
    scores, rollouts = table(cfg.run_dir, 0, "scores"), table(cfg.run_dir, 0, "rollouts")
    lengths = dict(zip(rollouts["rollout_id"].to_pylist(), rollouts["response"].to_pylist(), strict=True))
    for rid, raw in zip(scores["rollout_id"].to_pylist(), scores["reward_raw"].to_pylist(), strict=True):
        assert raw == float(len(lengths[rid]) % 3 == 0), rid  # the fixed reward, by hand

    # the same redo killed before train 0 commits, then `run` again: the same result
    k = cli("run", str(killed_path), "--quiet", "--redo-from", "0:score", fault="train:manifest")
    assert k.returncode == -9, k.stderr
    mark = redo.read(killed.run_dir)
    assert mark is not None and mark["from"] == [0, "score"]
    shown = status(killed.run_dir)
    assert shown[("0", "scores")] == shown[("0", "advantages")] == "complete"  # redone, committed
    assert all(shown[(str(it), f)] == "stale" for it, f in STAGES[3:]), shown  # train 0 on: to redo
    again = cli("run", str(killed_path), "--quiet")
    assert again.returncode == 0, again.stderr
    assert redo.read(killed.run_dir) is None
    redone = manifests_of(killed.run_dir)
    assert redone[(0, "rollouts")] == killed_before[(0, "rollouts")]
    assert len({redone[s].get("redo") for s in STAGES[1:]} - {None}) == 1
    assert all(redone[s].get("redo") for s in STAGES[1:])
    for it, f in STAGES:
        assert table(cfg.run_dir, it, f).equals(table(killed.run_dir, it, f)), (it, f)


def test_bad_redo_points_are_one_line_and_write_nothing(make_config, tmp_path: Path) -> None:
    from rlhf_batch.errors import UserError

    path, cfg = configure(make_config, tmp_path, "bad")
    stale_path, _ = make_config(name="stale.toml", run_dir=str(tmp_path / "bad"), max_staleness=1)
    for config, spec, words in [
        (path, "x:score", "K or K:STAGE"),
        (path, "0:scores", "no stage 'scores' in a run; stages: eval, generate, score, advantage, train"),
        (path, "0:score", "is not complete; nothing to redo"),
        (path, "5", "iterations 0..1"),
        (stale_path, "0:score", "not with max_staleness > 0"),
    ]:
        with pytest.raises(UserError) as e:
            run_pipeline(config, [], quiet=True, redo_from=spec)
        assert words in str(e.value) and "\n" not in str(e.value), spec
        assert redo.read(cfg.run_dir) is None
