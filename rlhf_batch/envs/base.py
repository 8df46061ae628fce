"""The environment protocol of multi-turn generation.

`generate.environment = "module:factory"` names a callable `factory(row) -> Environment`, called
once per trajectory with the prompt row (a dict of the prompt file's columns). The trajectory then
alternates: the policy samples an assistant turn, `env.step(text)` answers it. A `Step` whose
`observation` is None (or `done`) ends the trajectory; otherwise the observation is appended as a
message of role `role` (through the policy's chat template; a list of strings: one message each,
e.g. one tool result per call of the turn) and the policy samples again.
`reward_parts` are columns score can read (`env_<name>`), summed over the trajectory's steps.
`reward` is the part of the trajectory's score the turn just answered earned (0.0: none said),
recorded per assistant turn as `turn_rewards`: with `advantage.turn_credit = "to_go"` a later
turn is not credited with what earlier turns earned (docs/multi-turn.md, "Credit per turn")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Step:
    observation: str | list[str] | None = None
    role: str = "tool"  # "tool" or "user"
    done: bool = False
    reward_parts: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0

    @property
    def ends(self) -> bool:
        return self.done or self.observation is None or self.observation == []


class Environment(Protocol):
    def step(self, assistant_text: str) -> Step: ...
