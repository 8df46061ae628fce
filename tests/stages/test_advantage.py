"""The advantage stage: DuckDB SQL over real Parquet written through executor.claim, with
behaviour / reference log-probs from the real tiny model. Expected numbers are worked out by
hand in the comments; `math.sqrt` only spells out a root the comment derives."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_batch.errors import StageError
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.stages import advantage
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests, output
from rlhf_batch.store.schemas import ADVANTAGES, ROLLOUTS, SCORES, validate, with_extra
from tests.core.advantages_oracle import group_advantages, group_stats

NAN = float("nan")
EXTRA = pa.schema([("letter", pa.string()), ("count", pa.int64())])  # a prompt dataset's columns


@dataclass
class R:
    """One rollout to write: its prompt, reward (None / NaN: no reward), finish reason, response."""

    prompt_id: str
    reward: float | None
    finish: str = "stop"
    response: str = "ab"


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> tuple[Any, Any]:
    return load_model(str(tiny_model), "policy", dtype="float32"), load_tokenizer(str(tiny_model))


def tables(lm: tuple[Any, Any], it: int, rows: list[R]) -> tuple[pa.Table, pa.Table]:
    """(rollouts, scores) of `rows`; behaviour log-probs at temperature 1, reference at 0.5."""
    model, tok = lm
    prompts = [tok.encode(f"{r.prompt_id}=") for r in rows]
    responses = [tok.encode(r.response) for r in rows]
    seqs = [p + q for p, q in zip(prompts, responses, strict=True)]
    with torch.no_grad():
        behav, _, _ = response_logprobs(model, seqs, [len(p) for p in prompts], 1.0, pad_id=tok.pad_token_id)
        ref, _, _ = response_logprobs(model, seqs, [len(p) for p in prompts], 0.5, pad_id=tok.pad_token_id)
    seen: dict[str, int] = {}
    ids = []
    for r in rows:
        seen[r.prompt_id] = seen.get(r.prompt_id, -1) + 1
        ids.append((f"{it:04d}-{r.prompt_id}-{seen[r.prompt_id]}", seen[r.prompt_id]))
    b = [behav[i, : len(q)].tolist() for i, q in enumerate(responses)]
    f = [ref[i, : len(q)].tolist() for i, q in enumerate(responses)]
    kl = [[x - y for x, y in zip(bi, fi, strict=True)] for bi, fi in zip(b, f, strict=True)]
    roll = {
        "rollout_id": [i for i, _ in ids],
        "prompt_id": [r.prompt_id for r in rows],
        "sample_idx": [s for _, s in ids],
        "prompt": [f"{r.prompt_id}=" for r in rows],
        "prompt_ids": prompts,
        "response": [r.response for r in rows],
        "response_ids": responses,
        "behavior_logprobs": b,
        "finish_reason": [r.finish for r in rows],
        "policy": ["tiny"] * len(rows),
        "letter": ["a"] * len(rows),
        "count": [2] * len(rows),
    }
    score = {
        "rollout_id": roll["rollout_id"],
        "prompt_id": roll["prompt_id"],
        "reward_raw": [r.reward for r in rows],
        "score": [r.reward for r in rows],
        "ref_logprobs": f,
        "kl": kl,
        "kl_sum": [sum(k) for k in kl],
        "kl_coef": [0.0] * len(rows),
        "reward": [r.reward for r in rows],
    }
    rs = with_extra(ROLLOUTS, EXTRA)
    return (
        pa.table({k: pa.array(v, rs.field(k).type) for k, v in roll.items()}),
        pa.table({k: pa.array(v, SCORES.field(k).type) for k, v in score.items()}),
    )


def write_stage(
    run_dir: str, it: int, stage: str, table: pa.Table, schema: pa.Schema, parts: int = 2
) -> None:
    st = output.claim(layout.folder(run_dir, it, stage), stage, {"test": 1}, {})
    step = math.ceil(table.num_rows / parts)
    for n in range(parts):
        st.write_table(n, table.slice(n * step, step), schema)
    st.finish(parts)


def write_iteration(run_dir: str, it: int, rows: list[R], lm: tuple[Any, Any], scores: bool = True) -> None:
    roll, score = tables(lm, it, rows)
    write_stage(run_dir, it, "rollouts", roll, with_extra(ROLLOUTS, EXTRA))
    if scores:
        write_stage(run_dir, it, "scores", score, SCORES)


def result(cfg: Any, it: int = 0) -> dict[str, dict]:
    table = manifests.read_complete(layout.folder(cfg.run_dir, it, "advantages"), ADVANTAGES)
    return {row["rollout_id"]: row for row in table.to_pylist()}


def adv_of(res: dict[str, dict]) -> dict[str, float]:
    return {k: v["advantage"] for k, v in res.items()}


def setup(make_config: Any, lm: Any, rows: list[R], extra: str = "", **top: Any) -> tuple[Any, dict]:
    _, cfg = make_config(f"[advantage]\n{extra}", **top)
    write_iteration(cfg.run_dir, 0, rows, lm)
    return cfg, run_stage("advantage", cfg, 0, quiet=True)


def rewards(pid: str, values: list[float | None]) -> list[R]:
    return [R(pid, v) for v in values]


# ---------------------------------------------------------------- estimators by hand, at the SQL level


def test_grpo_default_by_hand(make_config: Any, lm: Any) -> None:
    cfg, m = setup(make_config, lm, rewards("p", [0.0, 1.0, 2.0]) + rewards("q", [3.0, 5.0]))
    res = result(cfg)
    # p: mean 1, sample var ((-1)^2 + 0 + 1^2) / 2 = 1 -> std 1; adv = (r - 1) / (1 + 1e-6) = +-0.999999000001
    # q: mean 4, sample var (1 + 1) / 1 = 2 -> std sqrt(2) = 1.41421356; adv = +-1 / (1.41421356 + 1e-6)
    #    1 / sqrt(2) = 0.70710678118, minus 1e-6 / 2 = 5e-7 -> 0.70710628118
    assert adv_of(res) == pytest.approx(
        {
            "0000-p-0": -0.999999000001,
            "0000-p-1": 0.0,
            "0000-p-2": 0.999999000001,
            "0000-q-0": -0.70710628118,
            "0000-q-1": 0.70710628118,
        },
        abs=1e-7,
    )
    assert [res[f"0000-p-{i}"]["group_mean"] for i in range(3)] == [1.0] * 3
    assert res["0000-q-0"]["group_mean"] == 4.0
    assert res["0000-p-0"]["group_std"] == pytest.approx(1.0, abs=1e-12)
    assert res["0000-q-1"]["group_std"] == pytest.approx(math.sqrt(2), abs=1e-12)
    assert [res["0000-p-0"]["group_size"], res["0000-q-0"]["group_size"]] == [3, 2]
    assert res["0000-q-1"]["reward"] == 5.0
    assert m["counts"]["rows_out"] == m["rows"] == 5


HAND = rewards("p", [1.0, 2.0, 4.0]) + rewards("q", [3.0, 7.0])
S14 = math.sqrt(14)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # p mean 7/3: 1 - 7/3 = -4/3, 2 - 7/3 = -1/3, 4 - 7/3 = 5/3; q mean 5: -2, +2
        ('estimator = "drgrpo"', [-4 / 3, -1 / 3, 5 / 3, -2.0, 2.0]),
        ('estimator = "grpo"\nscale = "none"', [-4 / 3, -1 / 3, 5 / 3, -2.0, 2.0]),
        # p: 1 - (2+4)/2 = -2, 2 - (1+4)/2 = -0.5, 4 - (1+2)/2 = 2.5; q: 3 - 7 = -4, 7 - 3 = 4
        ('estimator = "rloo"', [-2.0, -0.5, 2.5, -4.0, 4.0]),
        # ddof 0: p population var = (16/9 + 1/9 + 25/9) / 3 = 14/9 -> std sqrt(14)/3, so
        # adv = (-4/3, -1/3, 5/3) * 3 / sqrt(14) = (-4, -1, 5) / sqrt(14); q: var (4 + 4) / 2 = 4 -> +-2 / 2
        ("ddof = 0\neps = 0.0", [-4 / S14, -1 / S14, 5 / S14, -1.0, 1.0]),
        # batch {1, 2, 4, 3, 7}: mean 3.4, squares 5.76 + 1.96 + 0.36 + 0.16 + 12.96 = 21.2, / 4 = 5.3
        ('scale = "batch"\neps = 0.0', [x / math.sqrt(5.3) for x in (-4 / 3, -1 / 3, 5 / 3, -2.0, 2.0)]),
        # ddof 0: 21.2 / 5 = 4.24
        (
            'scale = "batch"\nddof = 0\neps = 0.0',
            [x / math.sqrt(4.24) for x in (-4 / 3, -1 / 3, 5 / 3, -2.0, 2.0)],
        ),
    ],
)
def test_estimators_by_hand(make_config: Any, lm: Any, extra: str, expected: list[float]) -> None:
    cfg, _ = setup(make_config, lm, HAND, extra)
    res = adv_of(result(cfg))
    ids = ["0000-p-0", "0000-p-1", "0000-p-2", "0000-q-0", "0000-q-1"]
    assert [res[i] for i in ids] == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------- SQL == core reference


def random_rows(seed: int, n: int = 48) -> list[R]:
    """Rewards on a quarter grid (many ties), ~15% null/NaN, singletons, and a constant group."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pid = f"g{int(rng.integers(0, 14))}"
        u = rng.random()
        reward = None if u < 0.08 else NAN if u < 0.15 else float(rng.integers(-4, 5)) / 4
        out.append(R(pid, reward, response="ab" * int(rng.integers(1, 6))))
    return out + [R("tie", 0.1), R("tie", None), R("tie", 0.1), R("tie", 0.1)]  # a constant group for sure


ESTIMATOR_CONFIGS = [
    ("grpo", "group", 1),
    ("grpo", "group", 0),
    ("grpo", "batch", 1),
    ("grpo", "batch", 0),
    ("grpo", "none", 1),
    ("drgrpo", "group", 1),
    ("rloo", "group", 1),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sql_matches_core_on_random_data(make_config: Any, lm: Any, seed: int) -> None:
    rows = random_rows(seed)
    _, cfg = make_config()
    write_iteration(cfg.run_dir, 0, rows, lm)
    rids = manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS)[
        "rollout_id"
    ].to_pylist()
    r = torch.tensor([NAN if x.reward is None else x.reward for x in rows], dtype=torch.float64)
    gid = [x.prompt_id for x in rows]
    scored = [i for i in range(len(rows)) if not math.isnan(r[i])]
    size, _, std = group_stats(r, gid)
    assert (size[scored] == 1).any() and (std[scored][size[scored] > 1] == 0).any()  # singletons and ties
    assert any(x.reward is None for x in rows) and any(x.reward != x.reward for x in rows)  # null and NaN
    for estimator, scale, ddof in ESTIMATOR_CONFIGS:
        extra = f'estimator = "{estimator}"\nscale = "{scale}"\nddof = {ddof}\n'
        _, cfg = make_config(f"[advantage]\n{extra}drop_zero_variance = false\nmin_group_size = 1")
        m = run_stage("advantage", cfg, 0, quiet=True, force=True)
        res = result(cfg)
        ref = group_advantages(r, gid, estimator=estimator, scale=scale, ddof=ddof)
        size, mean, std = group_stats(r, gid, ddof=ddof)
        assert sorted(res) == sorted(rids[i] for i in scored)
        assert m["counts"]["unscored"] == len(rows) - len(scored)
        for i in scored:
            row = res[rids[i]]
            assert row["advantage"] == pytest.approx(float(ref[i]), rel=1e-6, abs=1e-6)
            assert row["group_size"] == int(size[i])
            assert row["group_mean"] == pytest.approx(float(mean[i]), rel=1e-12, abs=1e-12)
            assert row["group_std"] == pytest.approx(float(std[i]), rel=1e-12, abs=1e-12)
            if float(std[i]) == 0.0:
                assert row["advantage"] == 0.0 and row["group_std"] == 0.0


# ---------------------------------------------------------------- degenerate groups, nulls


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_equal_rewards_give_exactly_zero(make_config: Any, lm: Any, estimator: str) -> None:
    # (0.7 * 3) / 3 = 0.6999999999999998 and sum([0.1] * 10) / 10 = 0.09999999999999999 in float64,
    # and TorchRL gives 0.06 for all-0.7; here: exactly 0, std exactly 0, mean the common value
    rows = rewards("a", [0.7] * 3) + rewards("b", [0.1] * 10) + rewards("c", [1.0, 2.0])
    cfg, m = setup(make_config, lm, rows, f'estimator = "{estimator}"\ndrop_zero_variance = false')
    res = result(cfg)
    for pid, value, n in (("a", 0.7, 3), ("b", 0.1, 10)):
        for i in range(n):
            row = res[f"0000-{pid}-{i}"]
            assert (row["advantage"], row["group_std"], row["group_mean"]) == (0.0, 0.0, value)
    assert res["0000-c-0"]["advantage"] < 0 < res["0000-c-1"]["advantage"]
    assert m["counts"]["groups_dropped_zero_variance"] == 0


def test_zero_variance_groups_dropped_by_default(make_config: Any, lm: Any) -> None:
    cfg, m = setup(make_config, lm, rewards("a", [0.7] * 3) + rewards("c", [1.0, 2.0]))
    assert sorted(result(cfg)) == ["0000-c-0", "0000-c-1"]
    c = m["counts"]
    assert (c["groups_total"], c["groups_dropped_zero_variance"], c["rows_dropped_zero_variance"]) == (
        2,
        1,
        3,
    )


def test_group_of_one(make_config: Any, lm: Any) -> None:
    rows = rewards("solo", [0.25]) + rewards("c", [1.0, 2.0])
    cfg, m = setup(make_config, lm, rows, "min_group_size = 1\ndrop_zero_variance = false")
    solo = result(cfg)["0000-solo-0"]
    assert (solo["advantage"], solo["group_size"], solo["group_mean"], solo["group_std"]) == (
        0.0,
        1,
        0.25,
        0.0,
    )
    # the default min_group_size = 2 drops it and counts it
    _, cfg2 = make_config("", run_dir=str(Path(cfg.run_dir).parent / "run2"), name="c2.toml")
    write_iteration(cfg2.run_dir, 0, rows, lm)
    c = run_stage("advantage", cfg2, 0, quiet=True)["counts"]
    assert (c["groups_dropped_small"], c["rows_dropped_small"], c["rows_out"]) == (1, 1, 2)


def test_null_rewards_excluded_before_statistics(make_config: Any, lm: Any) -> None:
    # non-null {1, 3}: n 2, mean 2, sample std sqrt((1 + 1) / 1) = sqrt(2); adv -+1 / (sqrt(2) + 0)
    cfg, m = setup(make_config, lm, rewards("p", [1.0, None, 3.0, NAN]), "eps = 0.0")
    res = result(cfg)
    assert sorted(res) == ["0000-p-0", "0000-p-2"]
    assert res["0000-p-2"]["advantage"] == pytest.approx(1 / math.sqrt(2), abs=1e-7)
    assert (res["0000-p-0"]["group_size"], res["0000-p-0"]["group_mean"]) == (2, 2.0)
    assert (m["counts"]["rows_in"], m["counts"]["unscored"], m["counts"]["rows_out"]) == (4, 2, 2)


def test_nan_reward_in_a_file_without_nulls(make_config: Any, lm: Any) -> None:
    # Parquet min/max leave NaN out (here min = max = 1); DuckDB must not conclude "no NaN" from them
    _, cfg = make_config("[advantage]\nmin_group_size = 1")
    roll, score = tables(lm, 0, rewards("p", [1.0, NAN, 1.0]) + rewards("q", [0.0, 2.0]))
    write_stage(cfg.run_dir, 0, "rollouts", roll, with_extra(ROLLOUTS, EXTRA), parts=1)
    write_stage(cfg.run_dir, 0, "scores", score.slice(0, 3), SCORES, parts=1)
    st = output.claim(layout.folder(cfg.run_dir, 0, "scores"), "scores", {"test": 1}, {})
    st.write_table(1, score.slice(3), SCORES)
    st.finish(2)
    m = run_stage("advantage", cfg, 0, quiet=True)
    # p without the NaN is {1, 1}: constant -> dropped (zero variance); q {0, 2} kept
    assert sorted(result(cfg)) == ["0000-q-0", "0000-q-1"]
    assert (m["counts"]["unscored"], m["counts"]["groups_dropped_zero_variance"]) == (1, 1)


# ---------------------------------------------------------------- filters and their counts

FILTER_ROWS = (
    rewards("g1", [0.0, 1.0])
    + rewards("g2", [0.5, 0.5, 0.5])  # zero variance
    + rewards("g3", [1.0])  # group of one
    + [R("g4", 0.0), R("g4", 1.0, "length"), R("g4", 1.0)]  # one truncated response
    + rewards("g5", [None, None])  # no reward at all: not a group
)


@pytest.mark.parametrize(
    ("mode", "counts"),
    [
        # rows_in 2 + 3 + 1 + 3 + 2 = 11, unscored 2; g1 and g4 kept (2 + 3 rows), g2 zero variance, g3 small
        (
            "keep",
            {
                "rows_in": 11,
                "unscored": 2,
                "truncated": 1,
                "truncated_dropped": 0,
                "truncated_zeroed": 0,
                "groups_total": 4,
                "groups_dropped_small": 1,
                "groups_dropped_zero_variance": 1,
                "rows_dropped_small": 1,
                "rows_dropped_zero_variance": 3,
                "rows_out": 5,
                "groups_out": 2,
            },
        ),
        ("drop", {"truncated_dropped": 1, "truncated_zeroed": 0, "rows_out": 4, "groups_out": 2}),
        ("zero", {"truncated_dropped": 0, "truncated_zeroed": 1, "rows_out": 5, "groups_out": 2}),
    ],
)
def test_filters_and_counts(make_config: Any, lm: Any, mode: str, counts: dict[str, int]) -> None:
    cfg, m = setup(make_config, lm, FILTER_ROWS, f'truncated = "{mode}"')
    assert {k: m["counts"][k] for k in counts} == counts
    assert m["rows"] == counts["rows_out"]
    res = result(cfg)
    assert {k.rsplit("-", 1)[0] for k in res} == {"0000-g1", "0000-g4"}
    g4 = [res.get(f"0000-g4-{i}") for i in range(3)]
    if mode == "keep":  # {0, 1, 1}: mean 2/3, sample var (4/9 + 1/9 + 1/9) / 2 = 1/3
        # truncated row: (1 - 2/3) / (sqrt(1/3) + 1e-6) = 0.5773503 - 1e-6 = 0.5773493
        assert g4[1]["advantage"] == pytest.approx(0.5773493, abs=2e-7)
    elif mode == "drop":  # truncated row left out before the statistics: {0, 1}, mean 0.5
        assert g4[1] is None and (g4[0]["group_size"], g4[0]["group_mean"]) == (2, 0.5)
    else:  # statistics as in "keep", the truncated row's advantage is 0
        assert g4[1]["advantage"] == 0.0 and g4[1]["group_mean"] == pytest.approx(2 / 3, abs=1e-15)
        # (0 - 2/3) / (sqrt(1/3) + 1e-6): -2/3 * sqrt(3) = -1.1547005, and the eps shrinks it by
        # 1.1547005 * 1e-6 / 0.5773503 = 2.0e-6 -> -1.1546985
        assert g4[0]["advantage"] == pytest.approx(-1.1546985, abs=2e-7)


def test_all_filtered_writes_no_part_and_says_why(make_config: Any, lm: Any) -> None:
    _, cfg = make_config()
    write_iteration(cfg.run_dir, 0, rewards("a", [0.5, 0.5]) + rewards("b", [1.0]), lm)
    m = run_stage("advantage", cfg, 0, quiet=True)
    assert (m["rows"], m["parts"], m["counts"]["rows_out"]) == (0, [], 0)
    msg = m["no_trainable_rows"]
    assert msg.startswith("every training row was filtered out")
    assert "drop_zero_variance=false" in msg and "min_group_size=2" in msg and "\n" not in msg
    # a relaxed config is another config: it replaces the empty folder with --force
    _, relaxed = make_config("[advantage]\ndrop_zero_variance = false\nmin_group_size = 1", name="r.toml")
    assert run_stage("advantage", relaxed, 0, force=True, quiet=True)["rows"] == 3
    assert "no_trainable_rows" not in manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages"))


def test_empty_and_missing_inputs(make_config: Any, lm: Any) -> None:
    _, cfg = make_config()
    with pytest.raises(
        StageError, match=r"rollouts of iteration 0 is not complete.*rlhf-batch generate --iter 0"
    ):
        run_stage("advantage", cfg, 0, quiet=True)
    roll, score = tables(lm, 0, rewards("a", [0.0, 1.0]))
    write_stage(cfg.run_dir, 0, "rollouts", roll, with_extra(ROLLOUTS, EXTRA))
    with pytest.raises(StageError, match=r"scores of iteration 0 is not complete.*rlhf-batch score --iter 0"):
        run_stage("advantage", cfg, 0, quiet=True)
    write_stage(cfg.run_dir, 0, "scores", score.slice(0, 0), SCORES, parts=1)  # an empty scores table
    with pytest.raises(StageError, match=r"iteration 0 .*scores are empty \(0 rows\)"):
        run_stage("advantage", cfg, 0, quiet=True)


def test_empty_iteration_is_an_error(make_config: Any, lm: Any) -> None:
    _, cfg = make_config()
    roll, score = tables(lm, 0, rewards("a", [0.0]))
    write_stage(cfg.run_dir, 0, "rollouts", roll.slice(0, 0), with_extra(ROLLOUTS, EXTRA), parts=1)
    write_stage(cfg.run_dir, 0, "scores", score.slice(0, 0), SCORES, parts=1)
    with pytest.raises(StageError, match=r"iteration 0 .*rollouts are empty \(0 rows\)"):
        run_stage("advantage", cfg, 0, quiet=True)


def test_scores_that_do_not_belong_to_the_rollouts(make_config: Any, lm: Any) -> None:
    _, cfg = make_config()
    roll, score = tables(lm, 0, rewards("a", [0.0, 1.0, 2.0]))
    write_stage(cfg.run_dir, 0, "rollouts", roll.slice(0, 2), with_extra(ROLLOUTS, EXTRA), parts=1)
    write_stage(cfg.run_dir, 0, "scores", score, SCORES, parts=1)
    with pytest.raises(StageError, match=r"1 score rows match no rollout \(e.g. rollout_id '0000-a-2'\)"):
        run_stage("advantage", cfg, 0, quiet=True)


def test_duplicate_and_mismatched_ids_are_named(make_config: Any, lm: Any) -> None:
    # rows line up by position, but a rollout_id appears twice (on both sides): the exact path names it
    _, cfg = make_config()
    roll, score = tables(lm, 0, rewards("a", [0.0, 1.0, 2.0]))
    dup = pa.concat_tables([roll, roll.slice(1, 1)]), pa.concat_tables([score, score.slice(1, 1)])
    write_stage(cfg.run_dir, 0, "rollouts", dup[0], with_extra(ROLLOUTS, EXTRA), parts=1)
    write_stage(cfg.run_dir, 0, "scores", dup[1], SCORES, parts=1)
    # 2 rollouts x 2 score rows of 0000-a-1 joined on rollout_id: 4 rows
    with pytest.raises(
        StageError,
        match=r"4 rows share their rollout_id .*'0000-a-1'.*redo it with `rlhf-batch generate CONFIG --iter 0 --force` then `rlhf-batch score CONFIG --iter 0 --force`",
    ):
        run_stage("advantage", cfg, 0, quiet=True)
    # the score row of 0000-a-2 says prompt "b"
    _, cfg2 = make_config(run_dir=str(Path(cfg.run_dir).parent / "mismatch"), name="m.toml")
    other = score.set_column(1, "prompt_id", pa.array(["a", "a", "b"]))
    write_stage(cfg2.run_dir, 0, "rollouts", roll, with_extra(ROLLOUTS, EXTRA), parts=1)
    write_stage(cfg2.run_dir, 0, "scores", other, SCORES, parts=1)
    with pytest.raises(StageError, match=r"1 score rows have another prompt_id .*'0000-a-2'"):
        run_stage("advantage", cfg2, 0, quiet=True)


def test_same_result_whatever_the_order_and_parts_of_the_scores(
    make_config: Any, lm: Any, tmp_path: Path
) -> None:
    # rollouts and scores in the same order (cut into 3 and 2 parts: chunks by common boundaries),
    # and scores in reverse order (no positional alignment: the pool is joined on rollout_id)
    rows = [R(f"p{i % 4}", float(i % 3)) for i in range(12)]
    roll, score = tables(lm, 0, rows)
    results = []
    for name, scores, parts in (
        ("same", score, 2),
        ("cut", score, 3),
        ("reversed", score.take(list(range(11, -1, -1))), 2),
    ):
        _, cfg = make_config(run_dir=str(tmp_path / name), name=f"{name}.toml")
        write_stage(cfg.run_dir, 0, "rollouts", roll, with_extra(ROLLOUTS, EXTRA), parts=2)
        write_stage(cfg.run_dir, 0, "scores", scores, SCORES, parts=parts)
        m = run_stage("advantage", cfg, 0, quiet=True)
        results.append(
            (manifests.read_complete(layout.folder(cfg.run_dir, 0, "advantages"), ADVANTAGES), m["counts"])
        )
    assert results[0][0].num_rows == 12
    assert all(t.equals(results[0][0]) and c == results[0][1] for t, c in results[1:])


# ---------------------------------------------------------------- window pooling


def test_window_pools_statistics_but_trains_on_current_rows(make_config: Any, lm: Any) -> None:
    _, cfg = make_config("[advantage]\nwindow = 2")
    write_iteration(cfg.run_dir, 0, rewards("p", [0.0, 0.0]) + rewards("old", [0.0, 1.0]), lm)
    write_iteration(cfg.run_dir, 1, rewards("p", [1.0, 1.0]) + rewards("q", [0.0, 1.0]), lm)
    m = run_stage("advantage", cfg, 1, quiet=True)
    res = result(cfg, 1)
    assert sorted(res) == ["0001-p-0", "0001-p-1", "0001-q-0", "0001-q-1"]  # no iteration-0 row is trained on
    # p pooled {0, 0, 1, 1}: mean 0.5, sample var 4 * 0.25 / 3 = 1/3; adv = 0.5 / (sqrt(1/3) + 1e-6)
    # 0.5 * sqrt(3) = 0.8660254, minus 0.5e-6 / (1/3) = 1.5e-6 -> 0.8660239
    p = res["0001-p-0"]
    assert (p["group_size"], p["group_mean"]) == (4, 0.5)
    assert p["advantage"] == pytest.approx(0.8660239, abs=1e-6)
    assert (m["window_iters"], m["counts"]["pooled_rows"], m["counts"]["groups_total"]) == ([0, 1], 4, 2)
    # window 1: p = {1, 1} alone is constant and dropped
    _, cfg1 = make_config("[advantage]\nwindow = 1", name="w1.toml")
    run_stage("advantage", cfg1, 1, quiet=True, force=True)
    assert sorted(result(cfg1, 1)) == ["0001-q-0", "0001-q-1"]


def test_window_skips_incomplete_older_iterations(make_config: Any, lm: Any) -> None:
    _, cfg = make_config("[advantage]\nwindow = 3")
    write_iteration(cfg.run_dir, 0, rewards("p", [0.0, 0.0]), lm, scores=False)  # never scored
    write_iteration(cfg.run_dir, 1, rewards("p", [1.0, 3.0]), lm)
    m = run_stage("advantage", cfg, 1, quiet=True)
    assert m["window_iters"] == [1] and m["counts"]["pooled_rows"] == 0
    assert result(cfg, 1)["0001-p-0"]["group_mean"] == 2.0  # (1 + 3) / 2, iteration 0 not pooled


# ---------------------------------------------------------------- parts: layout, order, readers, resume

SHARD_ROWS = [R(f"p{i % 5}", float(i % 3), response="ab" * (1 + i % 7)) for i in range(23)]


def documented_order(
    res_ids: list[str], lengths: dict[str, int], seed: int, it: int, width: int
) -> list[str]:
    """The order the module docstring documents, recomputed with hashlib (md5, little-endian)."""

    def md5(s: str) -> int:
        return int.from_bytes(hashlib.md5(s.encode()).digest(), "little")

    def key(rid: str) -> tuple:
        b = lengths[rid] // width
        return md5(f"{seed}:{it}:bucket:{b}"), b, md5(f"{seed}:{it}:row:{rid}"), rid

    return sorted(res_ids, key=key)


def test_parts_layout_order_and_readers(make_config: Any, lm: Any) -> None:
    cfg, m = setup(
        make_config, lm, SHARD_ROWS, "rows_per_part = 4\nbucket_tokens = 4\ndrop_zero_variance = false"
    )
    sdir = layout.folder(cfg.run_dir, 0, "advantages")
    # 23 rows -> parts of 4, 4, 4, 4, 4, 3
    assert [p["file"] for p in m["parts"]] == [f"part-00000-{n:05d}.parquet" for n in range(6)]
    assert [p["rows"] for p in m["parts"]] == [4, 4, 4, 4, 4, 3]
    assert sorted(q.name for q in sdir.iterdir()) == ["_manifest.json"] + [p["file"] for p in m["parts"]]
    for p in m["parts"]:
        schema = pq.read_schema(sdir / p["file"])
        validate(schema, ADVANTAGES, p["file"])
        assert schema.names == ADVANTAGES.names  # exactly the training columns: no letter/count
        assert pq.ParquetFile(sdir / p["file"]).metadata.row_group(0).column(0).compression == "ZSTD"
    ordered = pa.concat_tables([pq.read_table(sdir / p["file"]) for p in m["parts"]]).to_pylist()
    roll, score = tables(lm, 0, SHARD_ROWS)
    by_id = {r["rollout_id"]: r for r in roll.to_pylist()}
    ref_by_id = {r["rollout_id"]: r for r in score.to_pylist()}
    for row in ordered:
        src = by_id[row["rollout_id"]]
        assert row["input_ids"] == src["prompt_ids"] + src["response_ids"]
        assert row["prompt_len"] == len(src["prompt_ids"])
        assert row["behavior_logprobs"] == src["behavior_logprobs"]
        assert row["ref_logprobs"] == ref_by_id[row["rollout_id"]]["ref_logprobs"]
    ids = [r["rollout_id"] for r in ordered]
    lengths = {r["rollout_id"]: len(r["input_ids"]) for r in ordered}
    assert ids == documented_order(ids, lengths, seed=0, it=0, width=4)
    buckets = [lengths[i] // 4 for i in ids]
    runs = [b for k, b in enumerate(buckets) if k == 0 or b != buckets[k - 1]]
    assert len(runs) == len(set(runs)) > 1  # every bucket is one contiguous run
    got = duckdb.sql(
        f"SELECT count(*), sum(group_size) FROM read_parquet('{sdir}/part-*.parquet')"
    ).fetchall()
    assert got[0][0] == 23 and got[0][1] == sum(r["group_size"] for r in ordered)


def test_order_depends_on_seed_not_on_part_size(make_config: Any, lm: Any, tmp_path: Path) -> None:
    def ids(extra: str, name: str, seed: int) -> list[str]:
        cfg, m = setup(
            make_config,
            lm,
            SHARD_ROWS,
            f"{extra}\nbucket_tokens = 4\ndrop_zero_variance = false",
            run_dir=str(tmp_path / name),
            name=f"{name}.toml",
            seed=seed,
        )
        return [
            r
            for p in m["parts"]
            for r in pq.read_table(layout.folder(cfg.run_dir, 0, "advantages") / p["file"])[
                "rollout_id"
            ].to_pylist()
        ]

    base = ids("rows_per_part = 4", "a", 0)
    assert ids("rows_per_part = 7", "b", 0) == base
    assert ids("rows_per_part = 4", "c", 1) != base
    assert sorted(ids("rows_per_part = 4", "d", 1)) == sorted(base)


def test_rerun_resume_and_config_change(make_config: Any, lm: Any) -> None:
    cfg, m = setup(make_config, lm, SHARD_ROWS, "rows_per_part = 5\ndrop_zero_variance = false")
    sdir = layout.folder(cfg.run_dir, 0, "advantages")
    parts = [sdir / p["file"] for p in m["parts"]]
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in parts}
    assert run_stage("advantage", cfg, 0, quiet=True) == m  # complete: nothing is redone
    assert {p.name: p.stat().st_mtime_ns for p in parts} == {k: v[1] for k, v in before.items()}
    # an interrupted run: no manifest, part 2 missing -> only part 2 is written, identical bytes
    (sdir / layout.MANIFEST).unlink()
    parts[2].unlink()
    m2 = run_stage("advantage", cfg, 0, quiet=True)
    assert parts[2].read_bytes() == before[parts[2].name][0]
    assert all(p.stat().st_mtime_ns == before[p.name][1] for k, p in enumerate(parts) if k != 2)
    assert (m2["parts"], m2["counts"]) == (m["parts"], m["counts"])
    # another config is refused without --force, replaced with it
    _, other = make_config('[advantage]\nestimator = "rloo"', name="o.toml")
    with pytest.raises(StageError, match="different config"):
        run_stage("advantage", other, 0, quiet=True)
    assert (
        run_stage("advantage", other, 0, quiet=True, force=True)["config"]["advantage"]["estimator"] == "rloo"
    )
    manifest = json.loads((sdir / layout.MANIFEST).read_text())
    assert manifest["stage"] == "advantages" and set(manifest["inputs"]) == {
        "iter=0000/rollouts",
        "iter=0000/scores",
    }


def _spill(con: Any, rows: int = 4_000_000) -> None:
    """A sort that cannot fit in 100 MB: DuckDB writes it to the spill directory."""
    con.execute("SET memory_limit = '100MB'")
    con.execute(f"CREATE TEMP TABLE big AS SELECT md5(range::VARCHAR) AS h FROM range({rows})")
    assert con.execute("SELECT count(*) FROM (SELECT h FROM big ORDER BY h)").fetchall() == [(rows,)]


def test_connections_share_the_process_database_and_move_runs_after_a_spill(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / ".duckdb.tmp", tmp_path / "b" / ".duckdb.tmp"  # in two run directories
    a.parent.mkdir()
    b.parent.mkdir()
    con = advantage._connect(a)
    _spill(con)
    assert any(a.iterdir())  # the spill happened where it was told to
    db = advantage._DB["db"]
    con.close()
    again = advantage._connect(a)  # the next iteration of the same run: the same database
    assert advantage._DB["db"] is db
    # its own temp tables: the previous connection's `big` went with it
    assert again.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'big'").fetchall() == [(0,)]
    again.close()
    # another run: DuckDB cannot move a used spill directory, so a new database spills to b
    other = advantage._connect(b)
    assert advantage._DB["db"] is not db and not a.exists()
    _spill(other)
    assert any(b.iterdir())
    other.close()
    advantage._close_db()
    assert not b.exists() and not advantage._DB


def test_the_spill_directory_is_removed_at_exit(tmp_path: Path) -> None:
    import subprocess
    import sys

    d = tmp_path / ".duckdb.tmp"
    code = (
        "from pathlib import Path; from rlhf_batch.stages import advantage; "
        f"con = advantage._connect(Path({str(d)!r})); "
        "con.execute(\"SET memory_limit = '100MB'\"); "
        "con.execute('CREATE TEMP TABLE big AS SELECT md5(range::VARCHAR) AS h FROM range(4000000)'); "
        "con.execute('SELECT count(*) FROM (SELECT h FROM big ORDER BY h)').fetchall(); "
        "assert any(Path(" + repr(str(d)) + ").iterdir())"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    assert not d.exists()


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e6


def test_closing_the_stage_gives_duckdb_memory_back(tmp_path: Path) -> None:
    """DuckDB keeps a finished query's memory until its limit shrinks; the stage's close must
    hand it back before train runs in the same process (without `_release` RSS stays ~600 MB up)."""
    (tmp_path / "run").mkdir()
    con = advantage._connect(tmp_path / "run" / ".duckdb.tmp")
    before = _rss_mb()
    con.execute("CREATE TEMP TABLE big AS SELECT range AS x, md5(range::VARCHAR) AS h FROM range(5000000)")
    con.execute("SELECT count(*), max(h) FROM (SELECT * FROM big ORDER BY h)").fetchall()
    peak = _rss_mb()
    assert peak - before > 300  # the sort held hundreds of MB
    stage = advantage.Advantage.__new__(advantage.Advantage)
    stage.con = con
    stage.close()
    assert _rss_mb() - before < (peak - before) / 4
    advantage._close_db()


def test_groups_sql_drops_a_group_whose_task_scores_are_equal_though_its_rewards_differ() -> None:
    """advantage_groups.sql on a hand-made pool: with a KL-shaped reward (reward = score - beta*KL)
    a group of equal task scores has rewards that differ by the KL term alone; it carries no
    signal about the task and is dropped as zero_variance, like a group of equal rewards. A
    group whose scores differ is kept; with drop_zero_variance off all three are kept."""
    import duckdb

    from rlhf_batch.sql import sql_text

    con = duckdb.connect(":memory:")
    con.execute(
        "CREATE TEMP TABLE pool AS SELECT * FROM (VALUES "
        "('kl_only', 0, false, 0.9, 1.0, true), ('kl_only', 0, false, 0.8, 1.0, true), "
        "('equal', 0, false, 0.5, 0.5, true), ('equal', 0, false, 0.5, 0.5, true), "
        "('task', 0, false, 1.0, 1.0, true), ('task', 0, false, 0.0, 0.0, true)"
        ") AS t(prompt_id, iter, truncated, reward, score, used)"
    )

    def dropped(drop_zero_variance: bool) -> dict[str, str | None]:
        params = {"iter": 0, "ddof": 1, "min_group_size": 2, "drop_zero_variance": drop_zero_variance}
        con.execute(sql_text("advantage_groups"), params)
        return dict(con.execute("SELECT prompt_id, dropped FROM groups ORDER BY prompt_id").fetchall())

    assert dropped(True) == {"equal": "zero_variance", "kl_only": "zero_variance", "task": None}
    assert dropped(False) == {"equal": None, "kl_only": None, "task": None}
