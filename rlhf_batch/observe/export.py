"""`rlhf-batch export CONFIG --iter K --out DIR`: an iteration's rollouts, with their rewards, as
a Hugging Face dataset of chat messages (for SFT, rejection sampling or another trainer).

DIR/data/train-00000-of-00001.parquet holds one row per rollout (file order), readable with
`datasets.load_dataset(DIR)` or as Parquet: `messages` (role, content, tool_calls: OpenAI's
`{"type": "function", "function": {"name", "arguments"}}` with the arguments as a JSON string;
null where none), `rollout_id`, `prompt_id`, `sample_idx`, `iteration`, `finish_reason`,
`reward_raw`, `score`, `reward` (score's columns), and `tools` where the rollouts carry it.
The prompt's messages are `prompt_messages` (chat prompts), else one user message of the
prompt's text. A single-turn response is one assistant message; a multi-turn one (rollouts with
`turn_roles`) one message per segment, read from its tokens with the policy's chat template
(data/chat_turns.py). Assistant text is split into content and Hermes tool calls.
`min_reward`: only rows whose `score` is at least that (null scores are dropped).

`pairs` (`export --pairs`): preference pairs instead, one row per pair, in TRL's conversational
preference format: `prompt` (messages), `chosen` and `rejected` (the response messages of each
side: a multi-turn response's tool and user turns included, as the trajectory holds them), with
`prompt_id`, `chosen_id`, `rejected_id`, `chosen_reward`, `rejected_reward` (score's `reward`),
`iteration` (and `tools`). The pairs are those `advantage.pairs` and `advantage.pair_margin`
choose (data/selection.py, the same query and seeded order), among the iteration's scored
rollouts (the group filters of advantage are not applied: a group whose rewards are all equal has
no pair anyway).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_batch.config import Config
from rlhf_batch.data import chat_turns
from rlhf_batch.envs.tool_calls import ToolCallFormat, tool_format
from rlhf_batch.errors import ConfigError, SchemaError, StageError
from rlhf_batch.models.load import load_tokenizer
from rlhf_batch.store import layout
from rlhf_batch.store.manifests import read_complete
from rlhf_batch.store.schemas import ROLLOUTS, SCORES

DATA_FILE = "data/train-00000-of-00001.parquet"  # the Hub's layout: load_dataset(DIR) finds it
CALL = pa.struct(
    [("type", pa.string()), ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))]
)
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(CALL))])
REWARDS = ("reward_raw", "score", "reward")


def export(
    cfg: Config, iteration: int, out: Path, min_reward: float | None = None, pairs: bool = False
) -> tuple[Path, int]:
    """Write the dataset; returns its file and row count. DIR must not exist or be empty."""
    if min_reward is not None and not math.isfinite(min_reward):
        raise ConfigError(f"--min-reward: must be a finite number, got {min_reward}")
    if pairs and min_reward is not None:
        raise ConfigError(
            "--min-reward: not with --pairs (the pairs are chosen by advantage.pairs and advantage.pair_margin)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StageError(f"--out {out}: exists and is not an empty folder; remove it or give another")
    rollouts = read_complete(layout.folder(cfg.run_dir, iteration, layout.ROLLOUTS), ROLLOUTS)
    scores = read_complete(
        layout.folder(cfg.run_dir, iteration, layout.SCORES), SCORES, ["rollout_id", *REWARDS]
    )
    by_id = {r["rollout_id"]: r for r in scores.to_pylist()}
    tok = load_tokenizer(cfg.policy_model, cfg.trust_remote_code)
    fmt = tool_format(cfg.generate.tool_parser)  # how the policy wrote its tool calls
    if pairs:
        table = _pair_table(cfg, iteration, tok, fmt, rollouts, by_id)
        return _write(out, table), table.num_rows
    rows = []
    for r in rollouts.to_pylist():
        s = by_id.get(r["rollout_id"])
        if s is None:
            raise StageError(f"iter={iteration}: rollout {r['rollout_id']} has no score; redo score")
        if min_reward is not None and (s["score"] is None or s["score"] < min_reward):
            continue
        rows.append(_row(tok, fmt, r, s, iteration, f"iter={iteration}/rollouts: rollout {r['rollout_id']}"))
    table = _table(rows, "tools" in rollouts.column_names)
    return _write(out, table), table.num_rows


def _write(out: Path, table: pa.Table) -> Path:
    from rlhf_batch.store.atomic import write_dir_atomic

    def write(tmp: Path) -> None:  # the folder appears whole or not at all
        (tmp / DATA_FILE).parent.mkdir(parents=True)
        pq.write_table(table, tmp / DATA_FILE)

    write_dir_atomic(out, write)
    return out / DATA_FILE


def _pair_table(
    cfg: Config,
    iteration: int,
    tok: Any,
    fmt: ToolCallFormat,
    rollouts: pa.Table,
    scores: dict[str, dict[str, Any]],
) -> pa.Table:
    """One row per preference pair (module docstring), in pair order."""
    import duckdb

    from rlhf_batch.data import selection
    from rlhf_batch.store import fs, manifests

    values = {}
    for key, folder in (("rollout_files", layout.ROLLOUTS), ("score_files", layout.SCORES)):
        sdir = manifests.current(layout.folder(cfg.run_dir, iteration, folder))
        values[key] = [str(sdir / p["file"]) for p in (manifests.manifest(sdir) or {})["parts"]]
    con = duckdb.connect(":memory:")
    try:
        fs.register(con, fs.run_path(cfg.run_dir))
        where = f"iter={iteration}"
        selection.choose(con, cfg, iteration, "dpo", values, where, kept=False)
        found = con.execute(
            "SELECT c.rollout_id, r.rollout_id FROM selected c JOIN selected r USING (pair) "
            "WHERE c.chosen AND NOT r.chosen ORDER BY pair"
        ).fetchall()
    finally:
        con.close()
    by_id = {r["rollout_id"]: r for r in rollouts.to_pylist()}
    rows = []
    for chosen_id, rejected_id in found:
        c, r = by_id[chosen_id], by_id[rejected_id]
        prompt, chosen = _messages(tok, fmt, c, f"iter={iteration}/rollouts: rollout {chosen_id}")
        _, rejected = _messages(tok, fmt, r, f"iter={iteration}/rollouts: rollout {rejected_id}")
        rows.append(
            {
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "prompt_id": c["prompt_id"],
                "chosen_id": chosen_id,
                "rejected_id": rejected_id,
                "chosen_reward": scores[chosen_id]["reward"],
                "rejected_reward": scores[rejected_id]["reward"],
                "iteration": iteration,
                **({"tools": _json(c.get("tools"))} if "tools" in c else {}),
            }
        )
    fields = [
        ("prompt", pa.list_(MESSAGE)),
        ("chosen", pa.list_(MESSAGE)),
        ("rejected", pa.list_(MESSAGE)),
        ("prompt_id", pa.string()),
        ("chosen_id", pa.string()),
        ("rejected_id", pa.string()),
        ("chosen_reward", pa.float64()),
        ("rejected_reward", pa.float64()),
        ("iteration", pa.int32()),
        *([("tools", pa.string())] if "tools" in rollouts.column_names else []),
    ]
    return pa.Table.from_pylist(rows, schema=pa.schema(fields))


def _row(
    tok: Any, fmt: ToolCallFormat, r: dict[str, Any], s: dict[str, Any], iteration: int, where: str
) -> dict[str, Any]:
    prompt, response = _messages(tok, fmt, r, where)
    keep = ("rollout_id", "prompt_id", "sample_idx", "finish_reason")
    tools = r.get("tools")  # as given (a JSON string), or names or schemas as JSON
    return {
        "messages": prompt + response,
        **{k: r[k] for k in keep if k in r},
        **({"tools": _json(tools)} if "tools" in r else {}),
        "iteration": iteration,
        **{k: s[k] for k in REWARDS},
    }


def _messages(
    tok: Any, fmt: ToolCallFormat, r: dict[str, Any], where: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the prompt's messages, the response's) of rollout row `r`, tool calls read in `fmt`
    (generate.tool_parser's format)."""
    prompt = [
        {"role": m["role"], "content": m["content"], "tool_calls": None}
        for m in r.get("prompt_messages") or []
    ]
    if not prompt:
        prompt = [{"role": "user", "content": r["prompt"], "tool_calls": None}]
    if r.get("turn_roles"):
        if not r.get("turn_starts"):
            raise SchemaError(f"{where}: has 'turn_roles' but no 'turn_starts'; redo its generate or import")
        roles = [m["role"] for m in prompt]
        response = chat_turns.response_messages(
            tok, roles, r["response_ids"], r["turn_starts"], r["turn_roles"], where, fmt
        )
    else:
        response = [chat_turns.assistant_message(r["response"], [], fmt)]
    return prompt, response


def _json(v: Any) -> str | None:
    return (
        v if v is None or isinstance(v, str) else json.dumps(chat_turns.drop_null_keys(v), ensure_ascii=False)
    )


def _table(rows: list[dict[str, Any]], tools: bool) -> pa.Table:
    fields = [
        ("messages", pa.list_(MESSAGE)),
        ("rollout_id", pa.string()),
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("finish_reason", pa.string()),
        ("iteration", pa.int32()),
        *((k, pa.float64()) for k in REWARDS),
        *([("tools", pa.string())] if tools else []),
    ]
    schema = pa.schema(fields)
    return pa.Table.from_pylist(rows, schema=schema)
