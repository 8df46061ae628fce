"""The calculator task's environment (pipelines/calc.toml, docs/multi-turn.md): the built-in tool
environment with the calculator alone, which also says what turn 1 earned (`Step.reward`): the
call part of rlhf_batch.rewards.demo:calculator's score, 0.2 x the share of the right call
(its opening, the prompt's expression, its closing) that the turn wrote. With
`advantage.turn_credit = "to_go"` the turns are then credited apart (docs/multi-turn.md,
"Credit per turn").

    generate.environment = "rlhf_batch.envs.calc_task:calculator_task"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlhf_batch.envs.base import Step
from rlhf_batch.envs.demo import CALL_CLOSE, CALL_OPEN, CALL_WEIGHT, call_units, units_share
from rlhf_batch.envs.tools import BUILTIN, ToolEnvironment


@dataclass
class CalculatorTask(ToolEnvironment):
    expression: str = ""
    turn: int = 0

    def step(self, assistant_text: str) -> Step:
        self.turn += 1
        step = super().step(assistant_text)
        if self.turn > 1:
            return step
        call = units_share(call_units(assistant_text), [CALL_OPEN, *self.expression, CALL_CLOSE])
        return dataclasses.replace(step, reward=CALL_WEIGHT * call)


def calculator_task(row: dict[str, Any]) -> CalculatorTask:
    return CalculatorTask({"calculator": BUILTIN["calculator"]}, expression=str(row["expression"]))


calculator_task.reward_parts = ("tool_calls", "tool_errors")  # type: ignore[attr-defined]
