"""The multi-turn demo task: the prompt ``?*3=`` hides the letter; the environment reveals it.

Turn 1: the model asks (ideally just ``?``); the environment answers with the letter as a user
message (`<|im_start|>user\\nc<|im_end|>`: in the tiny model's character-level ChatML, 13 tokens
before the answer, where a tool message's `<tool_response>` markup puts 30). Turn 2: the model
writes that letter `count` times and stops; the environment scores it and ends the trajectory.
The letter is only in the environment's answer, so turn 2 depends on it: a policy that ignores
the observation answers at chance (docs/multi-turn.md, "The demo task").

Reward parts (columns env_asked, env_answer of the rollouts; rlhf_batch.rewards.demo:ask_letter
weighs them), both letter_count's score of a turn:
asked = that of turn 1 against "?" once (1.0 for exactly "?", 1/n for "?" and n - 1 more
characters, 0.0 when it does not start with "?"), answer = that of turn 2 against the letter.

    generate.environment = "rlhf_batch.envs.demo:ask_letter"
"""

from __future__ import annotations

from typing import Any

from rlhf_batch.envs.base import Step

ASKED_WEIGHT = 0.2  # asking first is worth a little of the score, the answer the rest (ask_letter)


def share(text: str, letter: str, count: int) -> float:
    """letter_count's score: the share of `letter` x `count` that `text` got right."""
    return sum(ch == letter for ch in text[:count]) / max(count, len(text))


class AskLetter:
    def __init__(self, row: dict[str, Any]):
        self.letter, self.count, self.turn = str(row["letter"]), int(row["count"]), 0

    def step(self, assistant_text: str) -> Step:
        self.turn += 1
        if self.turn == 1:
            asked = share(assistant_text, "?", 1)
            # the share of ask_letter's score this turn earns (advantage.turn_credit = "to_go")
            earned = ASKED_WEIGHT * asked
            return Step(self.letter, role="user", reward_parts={"asked": asked, "answer": 0.0}, reward=earned)
        answer = share(assistant_text, self.letter, self.count)
        return Step(done=True, reward_parts={"asked": 0.0, "answer": answer})


def ask_letter(row: dict[str, Any]) -> AskLetter:
    """The environment factory of the multi-turn demo task."""
    return AskLetter(row)


ask_letter.reward_parts = ("asked", "answer")  # type: ignore[attr-defined]  # env_asked, env_answer


# The calculator task (rlhf_batch.rewards.demo:calculator, envs/calc_task.py): its call credit
CALL_WEIGHT = 0.2  # the calculator task: calling the calculator is worth a little, the answer the rest
CALL_OPEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'  # models/tiny.py's
CALL_CLOSE = '"}}\n</tool_call>'
TURN_END = "<|im_end|>"  # ChatML's end of turn: the first assistant turn ends there


def units_share(got: list[str], want: list[str]) -> float:
    return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(want), len(got), 1)


def call_units(text: str) -> list[str]:
    """A turn's text as the tiny calculator model's tokens: the call's opening and closing are one
    unit each (as they are one token each, models/tiny.py CALCULATOR_TOKENS), any other character one."""
    out: list[str] = []
    while text:
        marker = next((m for m in (CALL_OPEN, CALL_CLOSE) if text.startswith(m)), text[0])
        out.append(marker)
        text = text[len(marker) :]
    return out
