"""The reward cache: a function's verdict on a rollout, kept under the run directory and reused.

With `score.reward_cache = true`, score, eval and audit look each (function, rollout) up before
calling the function, and store what they had to compute::

    RUN_DIR/reward_cache/<function name>/<source hash>/part-<keys hash>.parquet

one row per verdict: `key` (the rollout's content hash), `value` (float64, null for None) and
`extra` (a verl dict result's other keys, JSON of [[key, Cell], ...]; null when it gave none).

* The source hash is SHA-256 over the function's calling convention, its qualified name and the
  source text of its module (the whole file: editing the function, or anything else in its
  file, starts a new folder; a change in another module it calls, or in an installed package,
  does not: remove the function's folder then). A function whose source cannot be read (a
  builtin, a C extension) is not cached.
* The content hash is SHA-256 over everything a calling convention can pass for the rollout:
  prompt, response, prompt and response token ids and every carried prompt column (answer,
  messages, ...). The rollout id, iteration and sample index are not in it: the same prompt and
  response anywhere in the run (another iteration, a top-up round, eval, audit) is a hit.
* Each batch writes one new file with the verdicts it computed, named by the hash of their keys,
  atomically (store/atomic.py); concurrent ranks of a fan-out write files of their own and a
  killed writer leaves none half-written. A reader loads every file of the folder once per
  stage run (a file that is not a cache file, or holds a NaN, inf or a null key, is refused with
  one line naming it); two files with one key (two ranks that computed the same rollout) agree for a
  deterministic function, and the first file in name order wins otherwise.

The cache never changes a result of a function whose value for a rollout depends only on that
rollout: a hit is the value the function returned for the same inputs, bit for bit (float64 in
Parquet), and the misses of a batch are computed in one call on those rows, in batch order. A
function that scores a rollout relative to the rest of its batch must not be cached. A
nondeterministic function (a sampled judge) gives its first verdict again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlhf_batch.errors import StageError
from rlhf_batch.rewards import RewardFunction, time_limit
from rlhf_batch.rewards.concurrent import async_rows, is_async
from rlhf_batch.rewards.conventions import Extras, evaluate_rows, extra_columns
from rlhf_batch.store import layout

FOLDER = layout.REWARD_CACHE
SCHEMA = pa.schema([("key", pa.string()), ("value", pa.float64()), ("extra", pa.string())])


def source_hash(rf: RewardFunction) -> str | None:
    """SHA-256 of the function's convention, name and module source; None when unreadable."""
    fn = rf.fn
    try:
        module = inspect.getmodule(fn)
        text = inspect.getsource(module) if module is not None else inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    name = f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    return hashlib.sha256(f"{rf.convention}\0{name}\0{text}".encode()).hexdigest()


def content_keys(batch: dict[str, Any]) -> list[str]:
    """One SHA-256 per row over what a calling convention can pass for it (see the module)."""
    columns = batch["columns"]
    names = sorted(columns)
    out = []
    for i, prompt in enumerate(batch["prompts"]):
        row = [
            prompt,
            batch["responses"][i],
            batch["prompt_ids"][i],
            batch["response_ids"][i],
            [[c, columns[c][i]] for c in names],
        ]
        text = json.dumps(row, separators=(",", ":"), default=repr, allow_nan=True)
        out.append(hashlib.sha256(text.encode()).hexdigest())
    return out


class RewardCache:
    """The verdicts of one run directory, loaded per function on first use."""

    def __init__(self, root: Path):
        self.root = root
        self.known: dict[tuple[str, str], dict[str, tuple[float | None, str | None]]] = {}

    def folder(self, rf: RewardFunction, src: str) -> Path:
        return self.root / rf.name / src[:32]

    def entries(self, rf: RewardFunction, src: str) -> dict[str, tuple[float | None, str | None]]:
        slot = (rf.name, src)
        if slot not in self.known:
            from rlhf_batch.store.manifests import read_table

            found: dict[str, tuple[float | None, str | None]] = {}
            d = self.folder(rf, src)
            for f in sorted(d.glob("part-*.parquet")) if d.is_dir() else []:
                t = read_table(f)
                if t.schema != SCHEMA:
                    raise StageError(f"{f}: not a reward cache file (columns {t.schema.names}); remove it")
                for k, v, x in zip(*(t[c].to_pylist() for c in SCHEMA.names), strict=True):
                    if k is None or (v is not None and not math.isfinite(v)):
                        raise StageError(
                            f"{f}: a reward cache value is {v!r} (key {k!r}), not a finite number; remove the file"
                        )
                    found.setdefault(k, (v, x))
            self.known[slot] = found
        return self.known[slot]

    def store(
        self, rf: RewardFunction, src: str, keys: list[str], values: list[Any], more: list[Any]
    ) -> None:
        """Write the verdicts of `keys` as one new file (atomic) and keep them in memory."""
        from rlhf_batch.store.atomic import write_parquet_atomic

        fresh = {
            k: (v, x) for k, v, x in zip(keys, values, more, strict=True) if k not in self.entries(rf, src)
        }
        if not fresh:
            return
        name = hashlib.sha256("\n".join(sorted(fresh)).encode()).hexdigest()[:24]
        cols = [list(fresh), [v for v, _ in fresh.values()], [x for _, x in fresh.values()]]
        table = pa.Table.from_arrays(
            [pa.array(c, f.type) for c, f in zip(cols, SCHEMA, strict=True)], schema=SCHEMA
        )
        d = self.folder(rf, src)
        from rlhf_batch.store import fs

        fs.makedirs(d)
        write_parquet_atomic(d / f"part-{name}.parquet", table, SCHEMA)
        self.entries(rf, src).update(fresh)


class RewardCalls:
    """How a stage calls its reward functions: the time limit per batch, async concurrency and
    rate, and the cache (None: off). `counts` holds the cache's hits and misses since the last
    `take_counts`."""

    def __init__(
        self,
        timeout: float = 0.0,
        concurrency: int = 8,
        rate_per_s: float = 0.0,
        cache: RewardCache | None = None,
        policy: tuple[str, bool] | None = None,
        tool_parser: str = "hermes",
    ):
        self.timeout, self.concurrency, self.rate_per_s, self.cache = timeout, concurrency, rate_per_s, cache
        self.counts: Counter[str] = Counter()
        self.policy, self.tool_parser = policy, tool_parser  # the tokenizer of completion_messages
        self._tok: Any = None

    @classmethod
    def from_config(cls, cfg: Any) -> RewardCalls:
        from rlhf_batch.store.fs import run_path

        s = cfg.score
        cache = RewardCache(run_path(cfg.run_dir) / FOLDER) if s.reward_cache else None
        policy = (cfg.policy_model, cfg.trust_remote_code)
        return cls(
            s.reward_timeout,
            s.reward_concurrency,
            s.reward_rate_per_s,
            cache,
            policy,
            cfg.generate.tool_parser,
        )

    def batch(
        self, t: pa.Table, prompt_ids: list[list[int]], response_ids: list[list[int]]
    ) -> dict[str, Any]:
        """table_batch of `t`, its multi-turn rows' messages read with the policy's chat template
        (its tokenizer loaded on the first multi-turn batch)."""
        if self._tok is None and self.policy and "turn_roles" in t.column_names:
            from rlhf_batch.models.load import load_tokenizer

            self._tok = load_tokenizer(*self.policy)
        return table_batch(t, prompt_ids, response_ids, self._tok, self.tool_parser)

    def take_counts(self) -> dict[str, int]:
        """The hit and miss counts since the last call (none with the cache off), then zero."""
        out, self.counts = dict(self.counts), Counter()
        return out

    def values(
        self, fns: Sequence[RewardFunction], rid: list[str], batch: dict[str, Any]
    ) -> tuple[dict[str, list[float | None]], dict[str, pa.Array]]:
        """Each function's values (column -> one per row) and extra columns, as reward_values."""
        values, extra = {}, {}
        where = f" on rollouts {rid[0]}..{rid[-1]}" if rid else ""
        for rf in fns:
            said = (
                f"reward function {rf.path} did not return within {self.timeout:g} s (score.reward_timeout)"
            )
            with time_limit(self.timeout, said + where):
                values[rf.column], more = self.function_values(rf, rid, batch)
            extra.update(extra_columns(rf, more))
        return values, extra

    def call(
        self, rf: RewardFunction, rid: Sequence[str], batch: dict[str, Any]
    ) -> tuple[list[float | None], list[Extras] | None]:
        if is_async(rf.fn):
            return async_rows(rf, rid, batch, self.concurrency, self.rate_per_s)
        return evaluate_rows(rf, rid, **batch)

    def function_values(
        self, rf: RewardFunction, rid: list[str], batch: dict[str, Any]
    ) -> tuple[list[float | None], list[Extras] | None]:
        src = source_hash(rf) if self.cache is not None else None
        if self.cache is None or src is None:
            return self.call(rf, rid, batch)
        keys = content_keys(batch)
        known = self.cache.entries(rf, src)
        miss = [i for i, k in enumerate(keys) if k not in known]
        self.counts["reward_cache_hits"] += len(keys) - len(miss)
        self.counts["reward_cache_misses"] += len(miss)
        self.counts[f"reward_cache_hits_{rf.name}"] += len(keys) - len(miss)
        self.counts[f"reward_cache_misses_{rf.name}"] += len(miss)
        if miss:
            sub: dict[str, Any] = {k: [v[i] for i in miss] for k, v in batch.items() if k != "columns"}
            sub["columns"] = {c: [v[i] for i in miss] for c, v in batch["columns"].items()}
            got, more = self.call(rf, [rid[i] for i in miss], sub)
            rows: list[Extras] = more or [{} for _ in miss]
            texts = [json.dumps(list(m.items())) if m else None for m in rows]
            self.cache.store(rf, src, [keys[i] for i in miss], got, texts)
        entries = [known[k] for k in keys]
        values = [v for v, _ in entries]
        if rf.convention != "verl":
            return values, None
        return values, [dict(json.loads(x)) if x else {} for _, x in entries]


def table_batch(
    t: pa.Table,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    tok: Any = None,
    tool_parser: str = "hermes",
) -> dict[str, Any]:
    """The keyword arguments of call_reward_function for the rollouts rows `t`: prompts,
    responses, token ids, every carried column (each not in schemas.ROLLOUTS) as `columns`,
    and each row's `completion_messages` (data/chat_turns.completion_messages; multi-turn rows
    need the policy's tokenizer `tok`: without it the batch has none)."""
    from rlhf_batch.data.chat_turns import completion_messages
    from rlhf_batch.envs.tool_calls import tool_format
    from rlhf_batch.store.schemas import ROLLOUTS

    columns = {c: t[c].to_pylist() for c in t.column_names if c not in ROLLOUTS.names}
    batch = {
        "prompts": t["prompt"].to_pylist(),
        "responses": t["response"].to_pylist(),
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "columns": columns,
    }
    roles = columns.get("turn_roles") or [None] * t.num_rows
    if tok is not None or not any(roles):
        fmt, none = tool_format(tool_parser), [None] * t.num_rows
        rows = zip(
            batch["responses"], response_ids, roles, columns.get("turn_starts", none),
            columns.get("prompt_messages", none), strict=True,
        )  # fmt: skip
        keys = ("response", "response_ids", "turn_roles", "turn_starts", "prompt_messages")
        batch["completion_messages"] = [
            completion_messages(tok, dict(zip(keys, r, strict=True)), fmt) for r in rows
        ]
    return batch
