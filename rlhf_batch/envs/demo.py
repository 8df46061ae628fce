"""The multi-turn demo task: the prompt ``?*3=`` hides the letter; the environment reveals it.

Turn 1: the model asks (ideally just ``?``); the environment answers with the letter as a tool
message. Turn 2: the model writes that letter `count` times and stops; the environment scores it
and ends the trajectory. The letter is only in the environment's answer, so turn 2 depends on it.
Reward parts (columns env_asked, env_answer of the rollouts; rlhf_batch.rewards.demo:ask_letter
weighs them): asked = 1.0 when turn 1 is exactly "?", answer = letter_count's score of turn 2.

    generate.environment = "rlhf_batch.envs.demo:ask_letter"
"""

from __future__ import annotations

from typing import Any

from rlhf_batch.envs.base import Step


class AskLetter:
    def __init__(self, row: dict[str, Any]):
        self.letter, self.count, self.turn = str(row["letter"]), int(row["count"]), 0

    def step(self, assistant_text: str) -> Step:
        self.turn += 1
        if self.turn == 1:
            asked = float(assistant_text.strip() == "?")
            return Step(self.letter, role="tool", reward_parts={"asked": asked, "answer": 0.0})
        n, text = self.count, assistant_text
        answer = sum(ch == self.letter for ch in text[:n]) / max(n, len(text))
        return Step(done=True, reward_parts={"asked": 0.0, "answer": answer})


def ask_letter(row: dict[str, Any]) -> AskLetter:
    """The environment factory of the multi-turn demo task."""
    return AskLetter(row)
