"""`run` with max_staleness = 1: two lanes (sample: generate + score; learn: top-up, advantage,
train, eval), each a process. A SIGKILL at a named point of either lane fails the run with one
line naming the lane; a re-run resumes to the rows and weights of the uninterrupted overlapped
run. A SIGKILL of `run` itself takes both lanes down. Top-up rounds run in the learn lane."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout, manifests
from tests.reliability.harness import (
    KILLS,
    Assets,
    alive,
    assert_same_as_reference,
    children,
    command,
    environment,
    run,
    run_to_completion,
    wait_for,
)

ITERATIONS = 3  # iteration 2 samples from iteration 0's policy
STALE = ("--set", "max_staleness=1")


@pytest.fixture(scope="module")
def stale_reference(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("stale-reference") / "run"
    run_to_completion(assets, run_dir, *STALE, iterations=ITERATIONS)
    return run_dir


def _killed_in_lane(assets: Assets, run_dir: Path, point: str, lane: str, *extra: str) -> None:
    res = run(assets, run_dir, *STALE, *extra, fault=point, iterations=ITERATIONS)
    assert res.returncode == 1, f"{point}: exit {res.returncode}\n{res.stderr[-2000:]}"
    died = "exit -9" if "in_process=false" not in extra else "exit 1"  # the lane, or its stage process
    assert f"error: the {lane} lane failed ({died}); the other lane was stopped" in res.stderr, res.stderr[
        -2000:
    ]
    KILLS["named"] += 1


# each chain: points in one run directory, every re-run resuming the last; iteration 1's and 2's
# points fire once iteration 0's have fired
LANE_CHAINS = {
    "sample": ["rollouts:part-1:tmp", "scores:manifest", "rollouts:part-2:done", "scores:part-0:tmp"],
    "learn": ["advantages:part-1:tmp", "train:checkpoint-2", "train:policy:tmp", "train:manifest:done"],
}


@pytest.mark.slow
@pytest.mark.parametrize("lane", list(LANE_CHAINS))
def test_a_kill_in_either_lane_resumes_to_the_overlapped_reference(
    lane: str, assets: Assets, stale_reference: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    for point in LANE_CHAINS[lane]:
        _killed_in_lane(assets, run_dir, point, lane)
    run_to_completion(assets, run_dir, *STALE, iterations=ITERATIONS)
    assert_same_as_reference(run_dir, stale_reference, iterations=ITERATIONS)


@pytest.mark.slow
def test_a_stage_process_killed_in_a_lane_without_in_process(
    assets: Assets, stale_reference: Path, tmp_path: Path
) -> None:
    """Lanes whose stages run as processes of their own: a stage killed fails its lane (exit 1)."""
    run_dir = tmp_path / "run"
    child = ("--set", "in_process=false")
    _killed_in_lane(assets, run_dir, "train:checkpoint-2", "learn", *child)
    run_to_completion(assets, run_dir, *STALE, *child, iterations=ITERATIONS)
    assert_same_as_reference(run_dir, stale_reference, iterations=ITERATIONS)


@pytest.mark.slow
def test_a_killed_run_takes_both_lanes_down_and_resumes(
    assets: Assets, stale_reference: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        command(assets, run_dir, *STALE, iterations=ITERATIONS),
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # both lanes at work: iteration 1's rollouts begun while iteration 0 is not yet trained, or later
    wait_for(lambda: layout.folder(run_dir, 1, "rollouts").exists(), timeout=120)
    lanes = children(proc.pid)
    assert len(lanes) == 2, lanes  # the sample lane and the learn lane
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    KILLS["timed"] += 1
    wait_for(lambda: not any(alive(pid) for pid in lanes), timeout=30)
    run_to_completion(assets, run_dir, *STALE, iterations=ITERATIONS)
    assert_same_as_reference(run_dir, stale_reference, iterations=ITERATIONS)


@pytest.mark.slow
def test_top_up_rounds_run_in_the_learn_lane(assets: Assets, tmp_path: Path) -> None:
    """advantage.min_groups above what one round gives: top-up rounds of generate + score run
    before advantage (in the learn lane), sampled by the same policy as the iteration's generate."""
    run_dir = tmp_path / "run"
    sets = ("--set", "advantage.min_groups=48", "--set", "advantage.max_topup_rounds=1")
    res = run(assets, run_dir, *STALE, *sets, iterations=ITERATIONS)
    assert res.returncode == 0, res.stderr[-3000:]
    for it in range(ITERATIONS):
        main = manifests.manifest(layout.folder(run_dir, it, "rollouts"))
        extra = manifests.manifest(layout.folder(run_dir, it, "rollouts", topup=1))
        assert main is not None and extra is not None, f"iteration {it}: no top-up round"
        assert extra["inputs"]["policy"] == main["inputs"]["policy"], f"iteration {it}"
        assert manifests.manifest(layout.folder(run_dir, it, "train")) is not None


def test_a_lane_is_not_started_by_hand(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\nmax_staleness = 1\n')
    env = {k: v for k, v in os.environ.items() if k != "RLHF_BATCH_RUN_LOCKED"}
    cmd = [sys.executable, "-m", "rlhf_batch", "lane", "sample", str(config)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 1, res.stderr
    assert "error: `lane` runs under `rlhf-batch run`" in res.stderr, res.stderr


def test_an_unknown_lane_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\nmax_staleness = 1\n')
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "lane", "train", str(config)], capture_output=True, text=True
    )
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == "error: lane must be one of sample, learn, got 'train'", res.stderr
