"""advantage on SFT and DPO iterations (train.objective): the rows advantage.select keeps and the
preference pairs advantage.pairs makes, on real rollouts scored by the demo reward.

The rewards (rlhf_batch.rewards.demo.letter_count) of tests.stages.test_score's rollouts, worked
out by hand: response j of each prompt is "{l}{l}", "x{l}", "{l}{l}{l}", "zz":
    p0 "a*2=": aa 2/2 = 1.0, xa 1/2 = 0.5, aaa 2/3 = 0.667, zz 0
    p1 "b*3=": bb 2/3 = 0.667, xb 1/3 = 0.333, bbb 3/3 = 1.0, zz 0
    p2 "c*1=": cc 1/2 = 0.5, xc 0, ccc 1/3 = 0.333, zz 0
"""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_batch.data.selection import PAIRS
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.stages.advantage import Advantage
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train.stage import Train
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ADVANTAGES, SCORES, with_extra
from tests.stages.test_score import write_rollouts

HERE = "tests.stages.test_selection"


def constant_for_c(*, responses: list[str], letter: list[str], **_: Any) -> list[float]:
    """1 for every response of the prompt of 'c' (a zero-variance group), the response's length else."""
    return [1.0 if c == "c" else float(len(r)) for r, c in zip(responses, letter, strict=True)]


def advantages(cfg: Any, it: int = 0, schema: Any = ADVANTAGES) -> list[dict]:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "advantages"), schema).to_pylist()


def manifest(cfg: Any, it: int = 0) -> dict:
    return manifests.manifest(layout.folder(cfg.run_dir, it, "advantages")) or {}


def scored(make_config: Any, **tables: Any) -> Any:
    _, cfg = make_config(**tables)
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    return cfg


def sample(rollout_id: str) -> tuple[str, int]:
    """'0000-p1-2' -> ('p1', 2)."""
    _, p, j = rollout_id.split("-")
    return p, int(j)


def test_sft_keeps_the_best_k_per_prompt(make_config) -> None:
    cfg = scored(make_config, train={"objective": "sft"}, advantage={"select": {"best": 1}})
    run_stage("advantage", cfg, 0, quiet=True)
    # the best of each prompt: aa (p0, 1.0), bbb (p1, 1.0), cc (p2, 0.5)
    assert sorted(sample(r["rollout_id"]) for r in advantages(cfg)) == [("p0", 0), ("p1", 2), ("p2", 0)]
    m = manifest(cfg)
    assert m["objective"] == "sft" and m["select"] == {"best": 1}
    assert m["counts"]["rows_out"] == 3 and m["counts"]["rows_not_selected"] == 9
    assert m["config"]["advantage"]["objective"] == "sft"  # in the identity: another choice refuses it


def test_sft_min_reward_and_where_over_rollouts_and_scores_columns(make_config) -> None:
    select = {"best": 2, "min_reward": 0.5, "where": "len(response) = 2 OR reward_letter_count = 1"}
    cfg = scored(make_config, train={"objective": "sft"}, advantage={"select": select})
    run_stage("advantage", cfg, 0, quiet=True)
    # reward >= 0.5 and (2 characters or reward 1): p0 aa (1.0), xa (0.5); p1 bb (0.667), bbb (1.0);
    # p2 cc (0.5); then the best 2 per prompt: all of them
    got = sorted(sample(r["rollout_id"]) for r in advantages(cfg))
    assert got == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 2), ("p2", 0)]


def test_sft_keeps_groups_of_equal_rewards_the_zero_variance_filter_drops(make_config) -> None:
    cfg = scored(
        make_config,
        score={"reward_functions": [f"{HERE}:constant_for_c"]},
        train={"objective": "sft"},
        advantage={"select": {"best": 1}},
    )
    run_stage("advantage", cfg, 0, quiet=True)
    # p2's rewards are all 1: GRPO drops the group, SFT keeps its (seeded) best row
    prompts = sorted(sample(r["rollout_id"])[0] for r in advantages(cfg))
    assert prompts == ["p0", "p1", "p2"]
    assert manifest(cfg)["counts"]["groups_dropped_zero_variance"] == 0


def test_a_where_naming_no_column_is_one_line_and_one_reading_a_file_is_refused(make_config) -> None:
    cfg = scored(make_config, train={"objective": "sft"}, advantage={"select": {"where": "no_such > 1"}})
    with pytest.raises(StageError, match=r"advantage.select's where cannot run.*no_such"):
        run_stage("advantage", cfg, 0, quiet=True)
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages")) is None
    for where in ("rollout_id IN (SELECT rollout_id FROM read_parquet('/etc/x.parquet'))", "1; DROP TABLE t"):
        with pytest.raises(ConfigError, match="advantage.select"):
            make_config(train={"objective": "sft"}, advantage={"select": {"where": where}})


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ({"train": {"objective": "sft"}}, "'sft' trains on the rows advantage.select keeps"),
        ({"advantage": {"select": {"best": 1}}}, "advantage.select' chooses the rows"),
        ({"train": {"objective": "sft"}, "advantage": {"select": {"best": 0}}}, "best = k >= 1"),
        ({"train": {"objective": "sft"}, "advantage": {"select": {"top": 1}}}, "has no key 'top'"),
        (
            {
                "train": {"objective": ["dpo:2", "grpo"]},
                "advantage": {"replay": {"iterations": 1, "max_share": 0.2}},
            },
            "replays GRPO rows",
        ),  # fmt: skip
        ({"train": {"objective": ["sft:2", "dpo"]}}, "'sft' trains on the rows"),
        ({"train": {"objective": "ppo"}}, "must be one of grpo, sft, dpo"),
        ({"train": {"objective": "dpo", "dpo_beta": 0.0}}, "train.dpo_beta"),
    ],
)
def test_bad_objective_settings_are_one_line(make_config, tables: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(**tables)


def test_dpo_pairs_best_against_worst_with_the_stored_reference_log_probs(make_config) -> None:
    cfg = scored(make_config, train={"objective": "dpo"})
    run_stage("advantage", cfg, 0, quiet=True)
    rows = advantages(cfg, schema=with_extra(ADVANTAGES, PAIRS))
    pairs: dict[int, dict[bool, str]] = {}
    for r in rows:
        pairs.setdefault(r["pair"], {})[r["chosen"]] = r["rollout_id"]
    # train reads them in pair order, the chosen row first
    assert [(r["pair"], r["chosen"]) for r in rows] == [(k, c) for k in range(3) for c in (True, False)]
    got = sorted((sample(p[True]), sample(p[False])) for p in pairs.values())
    # p0: aa (1.0) over zz (0); p1: bbb (1.0) over zz (0); p2: cc (0.5) over xc or zz (both 0: the seed decides)
    assert got[:2] == [(("p0", 0), ("p0", 3)), (("p1", 2), ("p1", 3))]
    assert got[2][0] == ("p2", 0) and got[2][1] in (("p2", 1), ("p2", 3))
    # no reference model in train: each row carries the reference log-probs score stored
    ref = {s["rollout_id"]: s["ref_logprobs"] for s in manifests.read_complete(layout.folder(cfg.run_dir, 0, "scores"), SCORES).to_pylist()}  # fmt: skip
    assert all(r["ref_logprobs"] == ref[r["rollout_id"]] is not None for r in rows)
    m = manifest(cfg)
    assert m["objective"] == "dpo" and m["counts"]["pairs"] == 3 and m["counts"]["rows_out"] == 6
    assert m["counts"]["rows_unpaired"] == 6  # 12 rows, 6 in a pair


def test_dpo_every_pair_above_the_margin(make_config) -> None:
    cfg = scored(make_config, train={"objective": "dpo"}, advantage={"pairs": "all", "pair_margin": 0.4})
    run_stage("advantage", cfg, 0, quiet=True)
    rows = advantages(cfg, schema=with_extra(ADVANTAGES, PAIRS))
    by_pair: dict[int, dict[bool, dict]] = {}
    for r in rows:
        by_pair.setdefault(r["pair"], {})[r["chosen"]] = r
    got = sorted((sample(p[True]["rollout_id"]), sample(p[False]["rollout_id"])) for p in by_pair.values())
    # reward differences > 0.4: p0 1-0.5, 1-0, 0.667-0, 0.5-0; p1 1-0.333, 1-0, 0.667-0; p2 0.5-0 twice
    want = [
        (("p0", 0), ("p0", 1)), (("p0", 0), ("p0", 3)), (("p0", 1), ("p0", 3)), (("p0", 2), ("p0", 3)),
        (("p1", 0), ("p1", 3)), (("p1", 2), ("p1", 1)), (("p1", 2), ("p1", 3)),
        (("p2", 0), ("p2", 1)), (("p2", 0), ("p2", 3)),
    ]  # fmt: skip
    assert got == sorted(want)
    assert all(p[True]["reward"] - p[False]["reward"] > 0.4 for p in by_pair.values())


def test_no_pair_writes_no_row_and_says_which_setting(make_config) -> None:
    cfg = scored(make_config, train={"objective": "dpo"}, advantage={"pair_margin": 5.0})
    run_stage("advantage", cfg, 0, quiet=True)
    m = manifest(cfg)
    assert m["rows"] == 0 and "advantage.pair_margin=5.0" in m["no_trainable_rows"]


def train_identity(cfg: Any, it: int) -> dict:
    stage = Train(cfg, it)
    stage.total_steps = 0  # prepare() sets it from the run's schedule
    return stage.identity()


def test_objectives_are_in_the_identities_only_where_they_apply(make_config) -> None:
    _, plain = make_config()
    new = {"objective", "select", "pairs", "pair_margin", "dpo_beta", "dpo_loss"}
    for ident in (Advantage(plain, 0).identity(), train_identity(plain, 0)):
        assert not new & {k for table in ident.values() if isinstance(table, dict) for k in table}
    _, cfg = make_config(
        train={"objective": ["sft:1", "dpo:1", "grpo"]},
        advantage={"select": {"best": 1}, "pairs": "all", "pair_margin": 0.5},
    )
    a = [Advantage(cfg, k).identity()["advantage"] for k in range(3)]
    assert a[0]["objective"] == "sft" and a[0]["select"] == {"best": 1} and "pairs" not in a[0]
    assert (a[1]["objective"], a[1]["pairs"], a[1]["pair_margin"]) == ("dpo", "all", 0.5)
    assert "objective" not in a[2] and "select" not in a[2]
    t = [train_identity(cfg, k)["train"] for k in range(3)]
    assert t[0]["objective"] == "sft" and "dpo_beta" not in t[0]
    assert (t[1]["objective"], t[1]["dpo_beta"], t[1]["dpo_loss"]) == ("dpo", 0.1, "sigmoid")
    assert "objective" not in t[2]
