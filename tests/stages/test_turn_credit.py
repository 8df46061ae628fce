"""advantage.turn_credit = "to_go": an assistant turn's tokens carry the advantage of what the
trajectory earned from that turn on (core/turn_credit.py, sql/advantage_turns.sql), checked on
what the loss receives (train's micro-batch), with the expected numbers worked out here."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import pytest

from rlhf_batch.core.turn_credit import turn_token_advantages
from rlhf_batch.envs.base import Step
from rlhf_batch.errors import ConfigError
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train.data import load_rows, micro_batch
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ADVANTAGES, ROLLOUTS, SCORES


def test_each_assistant_segment_gets_its_turns_advantage() -> None:
    # segments: assistant [0, 3), tool [3, 5), assistant [5, 6), user [6, 8), assistant [8, 10)
    out = turn_token_advantages(
        10, [0, 3, 5, 6, 8], ["assistant", "tool", "assistant", "user", "assistant"], 0.7, [None, None, -0.25]
    )
    # turn 1 (None): the trajectory's 0.7; the tool's tokens 0; turn 2 has no value of its own
    # (None): 0.7; the user's 0; turn 3: -0.25
    assert out.tolist() == pytest.approx([0.7, 0.7, 0.7, 0, 0, 0.7, 0, 0, -0.25, -0.25])
    assert out.dtype == np.float32


class Earns:
    """Two turns: turn 1 earns (its length mod 4) / 4, turn 2 (its length mod 3) / 3; each said as
    the step's reward and as a reward part (env_first, env_second)."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.turn = 0

    def step(self, text: str) -> Step:
        self.turn += 1
        if self.turn == 1:
            x = (len(text) % 4) / 4
            return Step("go on", role="user", reward_parts={"first": x, "second": 0.0}, reward=x)
        y = (len(text) % 3) / 3
        return Step(done=True, reward_parts={"first": 0.0, "second": y}, reward=y)


def earns(row: dict[str, Any]) -> Earns:
    return Earns(row)


earns.reward_parts = ("first", "second")  # type: ignore[attr-defined]


def both(*, env_first: list[float], env_second: list[float], **_: Any) -> list[float]:
    return [a + b for a, b in zip(env_first, env_second, strict=True)]


CONFIG = """
[generate]
environment = "tests.stages.test_turn_credit:earns"
max_turns = 2
max_new_tokens = 5
[score]
reward_functions = ["tests.stages.test_turn_credit:both"]
[advantage]
turn_credit = "to_go"
drop_zero_variance = false
"""


@pytest.mark.parametrize("discount", [1.0, 0.0])
def test_a_turn_is_credited_with_what_it_earned_from_there_on(discount: float, make_config) -> None:
    _, cfg = make_config(CONFIG + f"turn_discount = {discount}\n")
    for stage in ("generate", "score", "advantage"):
        run_stage(stage, cfg, 0, quiet=True)
    folder = lambda f: layout.folder(cfg.run_dir, 0, f)  # noqa: E731
    rolls = {r["rollout_id"]: r for r in manifests.read_complete(folder("rollouts"), ROLLOUTS).to_pylist()}
    reward = {
        s["rollout_id"]: s["reward"] for s in manifests.read_complete(folder("scores"), SCORES).to_pylist()
    }
    for r in rolls.values():  # what the environment said each turn earned
        assert r["turn_rewards"] == pytest.approx([r["env_first"], r["env_second"]][: r["turns"]])
    # what turn 1 earned: x = turn_rewards[0]; turn 2: the rest of the reward, reward - x.
    # Returns: discount 1: turn 1 the reward (the trajectory's own advantage), turn 2 reward - x;
    # discount 0: turn 1 x, turn 2 reward - x. Each normalised over the group's rows that reached
    # the turn: (ret - mean) / (sample std + 1e-6), 0 when all are equal
    returns: dict[tuple[str, int], dict[str, float]] = {}
    for rid, r in rolls.items():
        x = r["turn_rewards"][0]
        if discount == 0.0:
            returns.setdefault((r["prompt_id"], 1), {})[rid] = x if r["turns"] == 2 else reward[rid]
        if r["turns"] == 2:
            returns.setdefault((r["prompt_id"], 2), {})[rid] = reward[rid] - x
    want: dict[tuple[str, int], float] = {}
    for (_, turn), group in returns.items():
        vals = list(group.values())
        for rid, ret in group.items():
            if len(vals) < 2:
                continue
            sd = statistics.stdev(vals)
            want[rid, turn] = 0.0 if max(vals) == min(vals) else (ret - statistics.fmean(vals)) / (sd + 1e-6)
    rows = load_rows(folder("advantages"))
    batch = micro_batch(rows, range(len(rows.rollout_ids)), "cpu")  # what the loss receives
    adv_col = {
        a["rollout_id"]: a["advantage"]
        for a in manifests.read_complete(folder("advantages"), ADVANTAGES).to_pylist()
    }
    differ = 0
    for k, rid in enumerate(rows.rollout_ids):
        r = rolls[rid]
        ends = [*r["turn_starts"][1:], len(r["response_ids"])]
        got = batch["advantages"][k].tolist()
        turn = 0
        for start, end, role in zip(r["turn_starts"], ends, r["turn_roles"], strict=True):
            if role != "assistant":
                assert not batch["mask"][k, start:end].any()  # the environment's tokens: not trained
                continue
            turn += 1
            value = want.get((rid, turn), adv_col[rid])
            assert got[start:end] == pytest.approx([value] * (end - start), abs=1e-5), (rid, turn)
            differ += abs(value - adv_col[rid]) > 1e-3
    assert differ > 0  # a turn is credited differently from the whole trajectory somewhere
    # the setting decides the stage's rows: recorded in its identity (absent when "trajectory")
    assert manifests.manifest(folder("advantages"))["config"]["advantage"]["turn_discount"] == discount


def test_to_go_refuses_what_it_cannot_credit_per_turn(make_config) -> None:
    with pytest.raises(
        ConfigError, match="'advantage.window' cannot be used with advantage.turn_credit = 'to_go'"
    ):
        make_config('[advantage]\nturn_credit = "to_go"\nwindow = 2\n')


def test_imported_trajectories_earn_everything_at_their_last_turn(make_config, tmp_path) -> None:
    """Imported message trajectories have no `turn_rewards` (and no `turns` column): with
    turn_discount 0 turn 1 has earned nothing (its returns all 0: advantage 0) and turn 2 the
    whole reward (its advantage the trajectory's, the same returns over the same group)."""
    from tests.stages.test_import_messages import msg, write_messages

    convs = [
        [msg("user", "q"), msg("assistant", "a" * k), msg("user", "more"), msg("assistant", "b" * (j + 1))]
        for k in (1, 2)
        for j in range(3)
    ]
    src = write_messages(tmp_path / "t.parquet", convs, letter=["b"] * 6, count=[2] * 6)
    _, cfg = make_config(
        '[advantage]\nturn_credit = "to_go"\nturn_discount = 0.0\ndrop_zero_variance = false\n',
        score={"reward_functions": ["tests.stages.test_score:length_reward"]},  # both turns' length
    )
    run_stage("import", cfg, 0, src)
    for stage in ("score", "advantage"):
        run_stage(stage, cfg, 0, quiet=True)
    rolls = {
        r["rollout_id"]: r
        for r in manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS).to_pylist()
    }
    rows = manifests.read_complete(layout.folder(cfg.run_dir, 0, "advantages"), ADVANTAGES).to_pylist()
    assert len(rows) == 6 and len({r["advantage"] for r in rows}) > 1
    for row in rows:
        r = rolls[row["rollout_id"]]
        (a1, a2) = [i for i, role in enumerate(r["turn_roles"]) if role == "assistant"]
        ends = [*r["turn_starts"][1:], len(r["response_ids"])]
        tok = row["token_advantages"]
        assert tok[r["turn_starts"][a1] : ends[a1]] == [0.0] * (ends[a1] - r["turn_starts"][a1])
        assert tok[r["turn_starts"][a2] : ends[a2]] == pytest.approx(
            [row["advantage"]] * (ends[a2] - r["turn_starts"][a2])
        )
