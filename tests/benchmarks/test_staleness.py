"""bench_staleness's arithmetic on hand-built figures (the benchmark itself runs `rlhf-batch run`
for minutes per seed: the lead's machine, `make bench-staleness`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_staleness as bs  # noqa: E402


def test_idle_fraction_of_a_lane() -> None:
    # busy 2 + 3 + 1 = 6 s of a 10 s process: idle 1 - 6/10 = 0.4
    assert bs.idle_fraction([2.0, 3.0, 1.0], 10.0) == pytest.approx(0.4)


def test_stages_split_into_lanes() -> None:
    stages = [
        {"stage": "rollouts", "topup": 0, "busy_s": 2.0},
        {"stage": "scores", "topup": 0, "busy_s": 1.0},
        {"stage": "rollouts", "topup": 1, "busy_s": 0.5},  # a top-up round: the learn lane runs it
        {"stage": "advantages", "topup": 0, "busy_s": 0.25},
        {"stage": "train", "topup": 0, "busy_s": 3.0},
    ]
    assert bs.lane_busy(stages) == {"sample": [2.0, 1.0], "learn": [0.5, 0.25, 3.0]}


def test_time_to_reach_a_score() -> None:
    times, scores = [10.0, 20.0, 30.0, 40.0], [0.1, 0.5, 0.4, 0.7]
    assert bs.time_to_reach(times, scores, 0.45) == 20.0  # 0.5 at 20 s is the first >= 0.45
    assert bs.time_to_reach(times, scores, 0.5) == 20.0  # reaching is >=
    assert bs.time_to_reach(times, scores, 0.6) == 40.0  # the dip to 0.4 at 30 s does not count
    assert bs.time_to_reach(times, scores, 0.8) is None


def test_seed_mean_curve() -> None:
    runs = [{"scores": [0.2, 0.6], "known_s": [10.0, 20.0]}, {"scores": [0.4, 0.8], "known_s": [14.0, 26.0]}]
    curve = bs.seed_mean(runs)
    assert curve["times"] == pytest.approx([12.0, 23.0])
    assert curve["scores"] == pytest.approx([0.3, 0.7])
    # sample std of (0.2, 0.4): sqrt((0.1^2 + 0.1^2) / 1) = 0.1414; / sqrt(2 seeds) = 0.1 (same for 0.6, 0.8)
    assert curve["se"] == pytest.approx([0.1, 0.1])


def test_final_scores_within_the_noise() -> None:
    # means 0.6 and 0.65: difference 0.05; each sample variance (0.1^2 + 0.1^2) / 2 = 0.01, / 3 seeds;
    # noise 2 * sqrt(0.01/3 + 0.01/3) = 2 * 0.08165 = 0.1633
    same = bs.within_noise([0.5, 0.7, 0.6], [0.55, 0.65, 0.75])
    assert same["difference"] == pytest.approx(0.05)
    assert same["noise"] == pytest.approx(0.163299, abs=1e-6)
    assert same["within"] is True
    # mean 1.0: difference 0.4 > 0.1633 (the same variances)
    worse = bs.within_noise([0.5, 0.7, 0.6], [0.9, 1.0, 1.1])
    assert worse["difference"] == pytest.approx(0.4) and worse["within"] is False


def test_summary_compares_each_mode_with_lock_step() -> None:
    def run(scores: list[float], known: list[float], wall: float, idle: float) -> dict:
        return {"scores": scores, "known_s": known, "wall_s": wall, "idle": {"sample": idle, "learn": idle}}

    runs = {
        0: [run([0.2, 0.6], [10.0, 20.0], 22.0, 0.5), run([0.4, 0.8], [14.0, 26.0], 28.0, 0.3)],
        1: [run([0.5, 0.9], [6.0, 12.0], 13.0, 0.1), run([0.5, 0.7], [8.0, 14.0], 15.0, 0.2)],
    }
    s = bs.summary(runs)
    # lock-step's seed-mean curve: scores (0.3, 0.7) at (12, 23) s; its final score 0.7, first reached at 23 s
    assert s["target_score"] == pytest.approx(0.7) and s["lock_step_reach_s"] == pytest.approx(23.0)
    # S = 1: scores (0.5, 0.8) at (7, 13) s: 0.7 first reached at 13 s; 23 / 13 = 1.769x
    one = s["modes"][1]
    assert one["reach_s"] == pytest.approx(13.0) and one["speedup"] == pytest.approx(23 / 13)
    assert one["wall_s"] == pytest.approx(14.0) and one["idle"]["sample"] == pytest.approx(0.15)
    # final scores (0.6, 0.8) vs (0.9, 0.7): difference 0.1; noise 2 * sqrt(0.02/2 + 0.02/2) = 0.2828
    assert one["final_vs_lock_step"]["difference"] == pytest.approx(0.1)
    assert one["final_vs_lock_step"]["noise"] == pytest.approx(0.282843, abs=1e-6)
    assert one["final_vs_lock_step"]["within"] is True
    assert s["modes"][0]["speedup"] == pytest.approx(1.0)
