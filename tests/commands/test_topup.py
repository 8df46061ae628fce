"""Dynamic sampling: top-up rounds of generate + score while an iteration has fewer informative
groups than advantage.min_groups, up to the cap; real in-process `run`s of the tiny model."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.config import load_config
from rlhf_batch.data import topup
from rlhf_batch.observe import tracking
from rlhf_batch.store import layout, manifests


def first_token_parity(*, response_ids: list[list[int]], **_: Any) -> list[float]:
    """1 when the first response token id is odd: about one group in 8 of 4 samples is constant."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in response_ids]


def test_every_prompt_rounds_take_the_whole_set_and_sample_indices_move_on(make_config) -> None:
    _, cfg = make_config()  # prompts_per_iteration = 0 (every prompt): no further prompts to take
    # every round of iteration 3 takes batch 3, i.e. epoch 3's positions [0, 12) in file order
    assert [topup.batch_index(cfg, 3, r) for r in (0, 1, 2)] == [3, 3, 3]
    assert [topup.sample_offset(cfg, r) for r in (0, 1, 2)] == [0, 4, 8]  # G = 4


def scores_of(run_dir: str, rounds: list[int]) -> dict[str, list[float]]:
    """Rewards by prompt_id over round 0 and `rounds` of iteration 0, read from the files."""
    groups: dict[str, list[float]] = defaultdict(list)
    for r in [0, *rounds]:
        for row in pq.read_table(layout.folder(run_dir, 0, "scores", r)).to_pylist():
            groups[row["prompt_id"]].append(row["reward"])
    return groups


def informative(groups: dict[str, list[float]]) -> int:
    """Groups the default filters keep: at least 2 rewards, not all equal."""
    return sum(1 for g in groups.values() if len(g) >= 2 and max(g) != min(g))


def run(make_config, run_dir: Path, min_groups: int) -> tuple[Path, Any]:
    score = {"reward_functions": ["tests.commands.test_topup:first_token_parity"], "kl_in_reward": False}
    adv = {"min_groups": min_groups, "max_topup_rounds": 2}
    path, cfg = make_config(
        name=f"{run_dir.name}.toml", run_dir=str(run_dir), in_process=True, score=score, advantage=adv
    )
    run_pipeline(path, [], quiet=True)
    return path, cfg


def assert_same_rounds(run_dir: str, ref_dir: str) -> None:
    """Round 1's rollouts, round 2's scores and the advantages of iteration 0 are equal in both runs
    (every column but the path of the policy that sampled)."""
    for folder, r in (("rollouts", 1), ("scores", 2), ("advantages", 0)):
        drop = ["policy"] if folder == "rollouts" else []
        a = pq.read_table(layout.folder(run_dir, 0, folder, r)).drop_columns(drop)
        b = pq.read_table(layout.folder(ref_dir, 0, folder, r)).drop_columns(drop)
        assert a.equals(b), folder


def test_topup_rounds_until_enough_groups_or_the_cap(make_config, tmp_path: Path) -> None:
    # 12 prompts: min_groups 13 can never be met -> both rounds of the cap, and no third
    _, cfg = run(make_config, tmp_path / "cap", 13)
    assert [layout.folder(cfg.run_dir, 0, "rollouts", r).is_dir() for r in (1, 2, 3)] == [True, True, False]
    adv = manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages"))
    assert adv["topup_rounds"] == [1, 2]
    gen1 = manifests.manifest(layout.folder(cfg.run_dir, 0, "rollouts", 1))
    assert (gen1["topup"], gen1["prompts_sampled"], gen1["rows"]) == (1, 12, 48)
    # every prompt per iteration: a round samples the whole set again, in file order
    round0 = pq.read_table(layout.folder(cfg.run_dir, 0, "rollouts"), columns=["prompt_id"])
    round1 = pq.read_table(layout.folder(cfg.run_dir, 0, "rollouts", 1), columns=["prompt_id"])
    assert round1["prompt_id"].to_pylist() == round0["prompt_id"].to_pylist()
    assert gen1["prompt_batch"]["positions"] == [0, 12]
    # round r's sample indices are 4r..4r+3: ids stay unique over the rounds
    ids = []
    for r in (0, 1, 2):
        t = pq.read_table(layout.folder(cfg.run_dir, 0, "rollouts", r)).to_pylist()
        assert {row["sample_idx"] for row in t} == set(range(4 * r, 4 * r + 4))
        ids += [row["rollout_id"] for row in t]
    assert len(ids) == len(set(ids)) == 144
    # advantage trains on every informative group of the three rounds, counted from the files
    groups = scores_of(cfg.run_dir, [1, 2])
    assert adv["counts"]["groups_out"] == informative(groups)
    assert adv["counts"]["rows_in"] == 144
    assert adv["rows"] == sum(len(g) for g in groups.values() if max(g) != min(g))

    # min_groups between what round 0 and rounds 0-1 give: exactly one top-up round
    c0, c01 = informative(scores_of(cfg.run_dir, [])), informative(scores_of(cfg.run_dir, [1]))
    assert c0 < c01, (c0, c01)  # the seed gives groups that round 1 makes informative
    _, one = run(make_config, tmp_path / "one", c01)
    assert manifests.manifest(layout.folder(one.run_dir, 0, "advantages"))["topup_rounds"] == [1]
    assert not layout.folder(one.run_dir, 0, "rollouts", 2).exists()
    # the same rounds as the first run, row for row (ids and seeds depend on the round only)
    for r in (0, 1):
        a = pq.read_table(layout.folder(one.run_dir, 0, "scores", r)).to_pylist()
        b = pq.read_table(layout.folder(cfg.run_dir, 0, "scores", r)).to_pylist()
        assert [(x["rollout_id"], x["reward"]) for x in a] == [(x["rollout_id"], x["reward"]) for x in b]


def test_topup_resumes_and_a_rerun_does_nothing(make_config, tmp_path: Path) -> None:
    path, cfg = run(make_config, tmp_path / "r", 13)
    adv_dir = layout.folder(cfg.run_dir, 0, "advantages")
    before = {p.name: p.read_bytes() for p in adv_dir.glob("part-*.parquet")}
    # a kill before round 2's scores manifest and everything after it
    (layout.folder(cfg.run_dir, 0, "scores", 2) / layout.MANIFEST).unlink()
    for folder in ("advantages", "train"):
        for p in sorted(layout.folder(cfg.run_dir, 0, folder).rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    run_pipeline(path, [], quiet=True)
    assert {p.name: p.read_bytes() for p in adv_dir.glob("part-*.parquet")} == before
    mtimes = {p: p.stat().st_mtime_ns for p in Path(cfg.run_dir).rglob("_manifest.json")}
    run_pipeline(path, [], quiet=True)
    assert {p: p.stat().st_mtime_ns for p in Path(cfg.run_dir).rglob("_manifest.json")} == mtimes
    assert load_config(path).advantage.min_groups == 13


@pytest.mark.slow
def test_run_killed_in_a_topup_round_resumes_to_the_same_rows(make_config, tmp_path: Path) -> None:
    # one process per stage (`--topup` on the command line), killed while round 1 generates
    import os
    import signal
    import subprocess
    import sys
    import time

    _, ref = run(make_config, tmp_path / "ref", 13)
    score = {"reward_functions": ["tests.commands.test_topup:first_token_parity"], "kl_in_reward": False}
    adv = {"min_groups": 13, "max_topup_rounds": 2}
    path, cfg = make_config(name="killed.toml", run_dir=str(tmp_path / "killed"), score=score, advantage=adv)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [sys.executable, "-m", "rlhf_batch", "run", str(path), "--quiet"]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    round1 = layout.folder(cfg.run_dir, 0, "rollouts", 1)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not list(round1.glob("part-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # run and its stage process
    proc.wait()
    assert list(round1.glob("part-*")) and manifests.manifest(round1) is None
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert_same_rounds(cfg.run_dir, ref.run_dir)


def test_a_topup_round_is_tracked_at_its_iteration_under_its_own_keys() -> None:
    # iter=0003/topup=02/scores: iteration 3 (not the round number), keys apart from round 0's
    assert tracking._where(layout.folder("r", 3, "scores", 2), "scores") == (3, "scores_topup02")
    assert tracking._where(layout.folder("r", 3, "rollouts"), "rollouts") == (3, "rollouts")


@pytest.mark.slow
def test_the_topup_command_runs_the_rounds_that_run_would(make_config, tmp_path: Path) -> None:
    # stage by stage, as a scheduler's tasks run them: generate, score, topup, advantage
    from tests.stages.cli_helpers import ok, stage

    _, ref = run(make_config, tmp_path / "ref", 13)  # `run`: rounds 1 and 2 (13 groups are never met)
    score = {"reward_functions": ["tests.commands.test_topup:first_token_parity"], "kl_in_reward": False}
    adv = {"min_groups": 13, "max_topup_rounds": 2}
    path, cfg = make_config(name="tasks.toml", run_dir=str(tmp_path / "tasks"), score=score, advantage=adv)
    for name in ("generate", "score"):
        stage(path, name)
    ok("topup", path, "--iter", 0, "--quiet")
    assert [manifests.manifest(layout.folder(cfg.run_dir, 0, "scores", r)) is not None for r in (1, 2)] == [
        True,
        True,
    ]
    assert not layout.folder(cfg.run_dir, 0, "rollouts", 3).exists()
    mtimes = {p: p.stat().st_mtime_ns for p in Path(cfg.run_dir).rglob("_manifest.json")}
    ok("topup", path, "--iter", 0, "--quiet")  # the rounds are complete: nothing more
    assert {p: p.stat().st_mtime_ns for p in Path(cfg.run_dir).rglob("_manifest.json")} == mtimes
    stage(path, "advantage")
    assert_same_rounds(cfg.run_dir, ref.run_dir)
    # min_groups 0 (the default): no rounds
    ok(
        "topup",
        path,
        "--iter",
        0,
        "--quiet",
        "--set",
        "advantage.min_groups=0",
        "--set",
        "run_dir=" + str(tmp_path / "none"),
    )
    assert not (tmp_path / "none").exists() or not list((tmp_path / "none").rglob("topup=*"))
