"""advantage.reward_normalization = "per_part" (GDPO): each part of reward_raw normalised within
its group before the weighted sum, on real rollouts scored by real reward functions. The
expected advantages are TRL's `normalize_then_sum`, written out below in plain Python."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ADVANTAGES
from tests.stages.test_score import by_id, write_rollouts

HERE = "tests.stages.test_advantage_gdpo"
EPS = 1e-4  # TRL's constant in normalize_then_sum


def hits(*, responses: list[str], letter: list[str], count: list[int], **_: object) -> list[float]:
    """The prompt's letter's occurrences in the response, times the prompt's `count` column."""
    return [float(r.count(c) * n) for r, c, n in zip(responses, letter, count, strict=True)]


def length(*, responses: list[str], **_: object) -> list[float]:
    return [float(len(r)) for r in responses]


def a_part(*, responses: list[str], letter: list[str], **_: object) -> list[float]:
    """2 when the response starts with the letter, else 0; 1 everywhere for the prompt of 'c'."""
    return [1.0 if c == "c" else 2.0 * r.startswith(c) for r, c in zip(responses, letter, strict=True)]


def b_part(*, responses: list[str], letter: list[str], **_: object) -> list[float]:
    """1 - a/2: with weights 1 and 2, a + 2b = 2 for every rollout."""
    return [1.0 if c == "c" else 1.0 - r.startswith(c) for r, c in zip(responses, letter, strict=True)]


def normalize_then_sum(
    parts: list[list[float]], weights: list[float], groups: list[list[int]]
) -> list[float]:
    """TRL's GRPOTrainer, multi_objective_aggregation = "normalize_then_sum": per group and part,
    (x - mean) / (sample std + 1e-4); the weighted sum; then (s - batch mean) / (batch sample std + 1e-4)."""
    n = len(parts)
    s = [0.0] * n
    for k, w in enumerate(weights):
        for g in groups:
            xs = [parts[i][k] for i in g]
            mean, std = statistics.fmean(xs), statistics.stdev(xs)
            for i in g:
                s[i] += w * (parts[i][k] - mean) / (std + EPS)
    mean, std = statistics.fmean(s), statistics.stdev(s)
    return [(x - mean) / (std + EPS) for x in s]


def advantages(cfg) -> dict[str, dict]:  # noqa: ANN001
    return by_id(manifests.read_complete(layout.folder(cfg.run_dir, 0, "advantages"), ADVANTAGES).to_pylist())


def test_per_part_equals_trls_normalize_then_sum(make_config) -> None:
    _, cfg = make_config(
        score={"reward_functions": [f"{HERE}:hits", f"{HERE}:length"], "reward_weights": [1.0, 0.5]},
        advantage={"reward_normalization": "per_part", "scale": "batch", "eps": EPS},
    )
    rows = write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    run_stage("advantage", cfg, 0, quiet=True)
    got = advantages(cfg)
    # parts per rollout: responses aa, xa, aaa, zz of letters a (count 2), b (3), c (1):
    # hits 4 2 6 0 | 6 3 9 0 | 2 1 3 0, length 2 2 3 2 in each group: unequal scales
    parts = [
        [hits(responses=[r["response"]], letter=[r["letter"]], count=[r["count"]])[0], len(r["response"])]
        for r in rows
    ]
    groups = [[i for i, r in enumerate(rows) if r["prompt_id"] == p] for p in ("p0", "p1", "p2")]
    want = normalize_then_sum(parts, [1.0, 0.5], groups)
    assert len(got) == 12
    for r, w in zip(rows, want, strict=True):
        assert got[r["rollout_id"]]["advantage"] == pytest.approx(w, rel=1e-5, abs=1e-6)
        assert got[r["rollout_id"]]["reward"] == parts[rows.index(r)][0] + 0.5 * parts[rows.index(r)][1]
    # every group of the sum mode gives other advantages: the hits part dominates its sum
    _, plain = make_config(
        score={"reward_functions": [f"{HERE}:hits", f"{HERE}:length"], "reward_weights": [1.0, 0.5]},
        advantage={"scale": "batch", "eps": EPS},
        run_dir=cfg.run_dir + "-sum",
    )
    write_rollouts(plain)
    run_stage("score", plain, 0, quiet=True)
    run_stage("advantage", plain, 0, quiet=True)
    other = advantages(plain)
    assert max(abs(other[k]["advantage"] - v["advantage"]) for k, v in got.items()) > 0.1
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages"))
    assert m["reward_parts"] == {"reward_hits": 1.0, "reward_length": 0.5}
    assert m["config"]["advantage"]["reward_normalization"] == "per_part"
    assert (
        "reward_normalization"
        not in manifests.manifest(layout.folder(plain.run_dir, 0, "advantages"))["config"]["advantage"]
    )


def test_the_zero_variance_filter_looks_at_the_parts(make_config) -> None:
    score = {"reward_functions": [f"{HERE}:a_part", f"{HERE}:b_part"], "reward_weights": [1.0, 2.0]}
    # sum mode: a + 2b = 2 for every rollout, so every group's rewards are equal: all dropped
    _, plain = make_config(score=score)
    write_rollouts(plain)
    run_stage("score", plain, 0, quiet=True)
    run_stage("advantage", plain, 0, quiet=True)
    counts = manifests.manifest(layout.folder(plain.run_dir, 0, "advantages"))["counts"]
    assert counts["groups_dropped_zero_variance"] == 3 and counts["rows_out"] == 0
    # per part: in the groups of a and b the parts vary (a 2 0 2 0; b 0 1 0 1), normalised
    # a_n = +-(2 - 1) / (std 1.1547 + eps) = +-0.866, b_n = -a_n, so 1 x a_n + 2 x b_n = -a_n: kept;
    # the group of c has both parts constant: dropped
    _, cfg = make_config(
        score=score, advantage={"reward_normalization": "per_part"}, run_dir=plain.run_dir + "-gdpo"
    )
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    run_stage("advantage", cfg, 0, quiet=True)
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages"))
    assert m["counts"]["groups_dropped_zero_variance"] == 1 and m["counts"]["rows_out"] == 8
    got = advantages(cfg)
    std_a = math.sqrt(4 / 3)  # sample std of 2 0 2 0 around 1
    signal = [-(1.0 / (std_a + 1e-6)), 1.0 / (std_a + 1e-6)]  # starts with the letter / does not
    # the group advantage of signals +-s: (x - 0) / (their sample std s * sqrt(4/3) + eps)
    for row in got.values():
        s = signal[0] if row["rollout_id"].endswith(("-0", "-2")) else signal[1]
        assert row["advantage"] == pytest.approx(s / (abs(s) * std_a + 1e-6), rel=1e-5)


def test_per_part_refuses_kl_in_the_reward_and_unrecorded_parts(make_config, tmp_path) -> None:
    with pytest.raises(
        ConfigError, match=r"'advantage.reward_normalization' = 'per_part' .* score.kl_in_reward"
    ):
        make_config(score={"kl_in_reward": True}, advantage={"reward_normalization": "per_part"})
    _, cfg = make_config(advantage={"reward_normalization": "per_part"})
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    path = layout.folder(cfg.run_dir, 0, "scores") / layout.MANIFEST
    m = manifests.read_json(path)
    del m["reward_parts"]  # a folder scored by an earlier version
    path.write_text(json.dumps(m))
    with pytest.raises(StageError, match=r"records no reward_parts .* run score again"):
        run_stage("advantage", cfg, 0, quiet=True)
