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


def ensure_demo_assets(cfg: Config) -> None:
    """Build the tiny demo model and the demo prompts where the config expects them (local paths
    or store URIs), if missing."""
    from rlhf_batch.models.tiny import init_model

    if cfg.policy_model and not (run_path(cfg.policy_model) / "config.json").exists():
        init_model(cfg.policy_model, seed=cfg.seed)
    prompts = cfg.generate.prompts
    if prompts and isinstance(prompts, str) and not run_path(prompts).exists():
        write_prompts(prompts, 256, seed=cfg.seed, hidden=cfg.generate.environment == ASK_ENV)
