"""The calculator task (data/demo.py, rewards/demo.py:calculator, the tiny model's calculator
tokens): a call is a few tokens, the built-in tool environment runs it, and the reward reads the
messages, so the answer must be in the last assistant turn, not only in the tool's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_batch.data.chat_turns import completion_messages
from rlhf_batch.data.demo import CALC_RANGE, write_calc_prompts
from rlhf_batch.envs.glue import observation_ids
from rlhf_batch.envs.tools import calculator_environment
from rlhf_batch.models.tiny import CALCULATOR_TOKENS, CALL_CLOSE, CALL_OPEN, build_tokenizer
from rlhf_batch.rewards.demo import calculator

TOK = build_tokenizer(extra_tokens=CALCULATOR_TOKENS)


def trajectory(turn1: str, turn2: str | None, expression: str = "37*58", answer: str = "2146") -> float:
    """The reward of a trajectory that the built-in calculator environment answers, its rollouts
    row built from the tokens as generate builds it (each turn ends on <|im_end|>)."""
    env, end = calculator_environment({}), TOK.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    starts, roles = [], []
    for text in [turn1] + ([turn2] if turn2 is not None else []):
        starts.append(len(ids))
        roles.append("assistant")
        ids += TOK(text, add_special_tokens=False)["input_ids"] + [end]
        step = env.step(text)
        if step.ends or text is turn2:
            break
        for seg in observation_ids(TOK, step.role, step.observation, end, True):
            starts.append(len(ids))
            roles.append(step.role)
            ids += seg
    row = {
        "response": TOK.decode(ids[:-1], skip_special_tokens=False),
        "response_ids": ids,
        "turn_starts": starts,
        "turn_roles": roles,
    }
    msgs = completion_messages(TOK, row)
    (value,) = calculator(
        responses=[row["response"]], completion_messages=[msgs], answer=[answer], expression=[expression]
    )
    return value


def test_a_call_is_seven_tokens_and_decodes_to_the_hermes_call() -> None:
    call = f"{CALL_OPEN}37*58{CALL_CLOSE}"
    assert call == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*58"}}\n</tool_call>'
    ids = TOK(call, add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and TOK.decode(ids) == call
    # without them the tokenizer is the character-level one it always was
    plain = build_tokenizer()
    assert len(plain) == len(TOK) - 4 and len(plain(call, add_special_tokens=False)["input_ids"]) == len(call)


def test_the_prompts_ask_for_a_four_digit_product(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in write_calc_prompts(tmp_path / "p.jsonl", 200, seed=3).open()]
    assert len(rows) == 200 and len({r["id"] for r in rows}) == 200
    for r in rows:
        a, b = (int(x) for x in r["expression"].split("*"))
        assert CALC_RANGE[0] <= a <= CALC_RANGE[1] and CALC_RANGE[0] <= b <= CALC_RANGE[1]
        assert r["prompt"] == f"{a}*{b}=" and r["answer"] == str(a * b) and len(r["answer"]) == 4


def test_the_reward_of_a_trajectory() -> None:
    """0.2 x call + 0.8 x answer; call: the tokens of the right call [open, 3, 7, *, 5, 8, close]
    that the first turn got right in place, over max(7, its tokens); answer: the digits of 2146
    that the last assistant turn got right in place, over max(4, its length). By hand:"""
    call = f"{CALL_OPEN}37*58{CALL_CLOSE}"
    assert trajectory(call, "2146") == 1.0  # 0.2 x 7/7 + 0.8 x 4/4
    assert abs(trajectory("2146", None) - 0.8) < 1e-12  # no call: 0.2 x 0/7 + 0.8 x 1
    # the tool's 2146 is in the flat response, not in the last assistant turn: the call's 0.2 only
    assert abs(trajectory(call, "I do not know") - 0.2) < 1e-12
    # 37*5 runs (185): [open, 3, 7, *, 5, close] has 5 of 7 in place; "185": no digit in place
    assert abs(trajectory(f"{CALL_OPEN}37*5{CALL_CLOSE}", "185") - 0.2 * 5 / 7) < 1e-12
    # a call not closed (the tool answers an error): 6 of 7; then "2140": 3 of 4 digits
    assert abs(trajectory(f"{CALL_OPEN}37*58", "2140") - (0.2 * 6 / 7 + 0.8 * 3 / 4)) < 1e-12
    # one digit too many: 4 right of max(4, 5)
    assert abs(trajectory(call, "21460") - (0.2 + 0.8 * 4 / 5)) < 1e-12


def test_the_task_environment_says_what_turn_1_earned() -> None:
    """envs/calc_task.py: turn 1's Step.reward is the reward's call part, 0.2 x the share of the
    right call's units (opening, the expression's characters, closing) the turn wrote in place;
    the calculator still answers the call; later turns earn nothing of their own."""
    from rlhf_batch.envs.calc_task import calculator_task

    env = calculator_task({"expression": "37*58"})
    step = env.step(f"{CALL_OPEN}37*58{CALL_CLOSE}")  # 7 of 7 units right: 0.2 x 1
    assert step.reward == 0.2 and step.observation == ["2146"]
    assert calculator_task({"expression": "37*58"}).step(f"{CALL_OPEN}37*5").reward == pytest.approx(
        0.2 * 5 / 7
    )  # 5 of 7 in place
    # 3 in place (the opening, 3 and 7), "xx" wrong; 5 units written, 7 wanted: 0.2 x 3 / max(7, 5)
    assert calculator_task({"expression": "37*58"}).step(f"{CALL_OPEN}37xx").reward == pytest.approx(
        0.2 * 3 / 7
    )
    assert env.step("2146").reward == 0.0
