"""The demo task's assets: its prompts (write a given letter N times, then stop; procedural, so
no download) and, for `demo = true`, the tiny model and prompt file built where the config
expects them. The reward is rlhf_batch.rewards.demo.letter_count."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_batch.store.atomic import write_file_atomic
from rlhf_batch.store.fs import makedirs, run_path

if TYPE_CHECKING:
    from rlhf_batch.config import Config

LETTERS = "abcde"


MAX_COUNT = 4


ASK_ENV = "rlhf_batch.envs.demo:ask_letter"  # the multi-turn demo task's environment
CALC_REWARD = "rlhf_batch.rewards.demo:calculator"  # the calculator task's reward (with tools or not)
CALC_RANGE = (32, 99)  # the operands: every product has 4 digits (32 x 32 = 1024, 99 x 99 = 9801)


def write_prompts(path: str | Path, n: int, seed: int = 0, hidden: bool = False) -> Path:
    """Write `n` demo prompts as JSONL: id, prompt, letter, count, at a local path or a store URI
    (one PUT). `hidden`: the multi-turn task's prompts, "?*3=" (the environment reveals the
    letter; envs/demo.py)."""
    combos = [(c, k) for c in LETTERS for k in range(1, MAX_COUNT + 1)]
    rng = random.Random(seed)
    p = run_path(path)
    rows = []
    for i in range(n):
        c, k = rng.choice(combos)
        rows.append(
            json.dumps(
                {"id": f"demo-{i:06d}", "prompt": f"{'?' if hidden else c}*{k}=", "letter": c, "count": k}
            )
            + "\n"
        )
    makedirs(p.parent)
    write_file_atomic(p, lambda tmp: tmp.write_text("".join(rows)))
    return p


def write_calc_prompts(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write `n` prompts of the calculator task as JSONL: id, prompt ("37*58="), expression
    ("37*58") and answer ("2146"), the operands drawn from CALC_RANGE."""
    rng = random.Random(seed)
    p = run_path(path)
    rows = []
    for i in range(n):
        a, b = (rng.randint(*CALC_RANGE) for _ in range(2))
        row = {"id": f"calc-{i:06d}", "prompt": f"{a}*{b}=", "expression": f"{a}*{b}", "answer": str(a * b)}
        rows.append(json.dumps(row) + "\n")
    makedirs(p.parent)
    write_file_atomic(p, lambda tmp: tmp.write_text("".join(rows)))
    return p


def ensure_demo_assets(cfg: Config) -> None:
    """Build the tiny demo model and the demo prompts where the config expects them (local paths
    or store URIs), if missing. The calculator task (its reward function in score.reward_functions)
    gets the model with the calculator's tokens and 1,024 arithmetic prompts."""
    from rlhf_batch.models.tiny import CALCULATOR_TOKENS, init_model

    calc = CALC_REWARD in cfg.score.reward_functions
    if cfg.policy_model and not (run_path(cfg.policy_model) / "config.json").exists():
        init_model(cfg.policy_model, seed=cfg.seed, extra_tokens=CALCULATOR_TOKENS if calc else ())
    prompts = cfg.generate.prompts
    if prompts and isinstance(prompts, str) and not run_path(prompts).exists():
        if calc:
            write_calc_prompts(prompts, 1024, seed=cfg.seed)
        else:
            write_prompts(prompts, 256, seed=cfg.seed, hidden=cfg.generate.environment == ASK_ENV)
