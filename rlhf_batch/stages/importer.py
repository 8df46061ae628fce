"""``rlhf-batch import FILE``: externally produced (prompt, response) rows -> ``iter=K/rollouts``.
(Rows of chat messages, multi-turn trajectories with tool calls: import_messages.py.)

The file is JSONL or Parquet with string columns ``prompt`` and ``response``, optionally
``prompt_id`` (default: the first 16 hex digits of the prompt's sha256) and ``finish_reason``
('stop' | 'length', default 'stop'). Every other column is carried along, so reward functions
receive it. Decisions:

* The prompt is tokenised as the tokenizer does by default (special tokens added, e.g. a BOS),
  the response without special tokens.
* An imported response is complete unless marked 'length': its finish_reason is 'stop' and the
  EOS token is appended to ``response_ids`` unless it is already the last token (the
  ``response`` text stays as given). A 'length' row keeps its tokens as they are.
* ``sample_idx`` is the row's rank among the file's rows with the same ``prompt_id``;
  ``rollout_id`` = ``f"{K:04d}-{prompt_id}-{sample_idx}"`` as generate writes it. One
  ``prompt_id`` with two different prompts is an error.
* Behaviour log-probs come from the policy generate of iteration K would sample from
  (``policy_model`` for K = 0, else ``iter=K-1/policy``; with ``max_staleness = S``, the policy
  of iteration K-1-S, models/policy.sampling_policy: imported rows stand in for generate's,
  and an external engine running S iterations ahead has only that policy) at
  ``generate.temperature``, through the same log-prob function as generate and score; the
  ``policy`` column holds that directory, the manifest its ``policy_iteration`` and ``staleness``.
* Rows from an external engine may carry ``response_ids`` (list of ints) and with them
  ``behavior_logprobs`` (list of floats, one per response token): they are kept as given, the
  response is not re-tokenised (no EOS appended) and, with log-probs, none are recomputed.
  They are checked: ids in the policy's vocabulary, one log-prob per token, finite, <= 0.
* A row of more tokens than the policy's positions (``max_position_embeddings``) is refused with
  one line; one whose text is too long to fit whatever its tokens is refused before it is
  tokenised (a message of tens of megabytes costs no memory).
* Parts of ``score.rows_per_part`` rows in file order, forward batches of
  ``score.max_tokens_per_batch`` tokens (import feeds score, and shares its batching knobs).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from rlhf_batch.config import Config
from rlhf_batch.errors import ConfigError, SchemaError, StageError
from rlhf_batch.models.forward import batched_logprobs
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.models.policy import sampled_by, sampling_policy
from rlhf_batch.runtime import dist
from rlhf_batch.stages import import_messages
from rlhf_batch.stages.base import Part, Stage, list_tokens
from rlhf_batch.stages.executor import execute
from rlhf_batch.stages.import_rows import (
    COMPUTED,
    GIVEN,
    add_ids,
    check_given_ids,
    check_given_logprobs,
    check_positions,
    no_nulls,
    positions_of,
)
from rlhf_batch.store import layout
from rlhf_batch.store.manifests import file_fingerprint
from rlhf_batch.store.modeldir import model_fingerprint
from rlhf_batch.store.schemas import LOGPROBS, ROLLOUTS, TOKENS, with_extra


class Import(Stage):
    """Rollouts from a file instead of generate: parts of `score.rows_per_part` rows in file order."""

    name, folder, unit, in_pipeline = "import", layout.ROLLOUTS, "row", False

    def __init__(self, cfg: Config, iteration: int, file: str | Path):
        super().__init__(cfg, iteration)
        self.path: Path = Path(file)
        self.rows: pa.Table  # prepare(): the file's rows, checked
        self.messages: bool  # prepare(): the rows are trajectories as chat messages
        self.policy: str  # prepare(): the policy the rows are said to be sampled from
        self.tok: Any  # open(): the policy's tokenizer
        self.model: Any  # open(): the policy (behaviour log-probs of rows without them)

    def prepare(self) -> None:
        rows = read_rows(self.path)
        self.messages = import_messages.MESSAGES in rows.column_names  # trajectories as chat messages
        prep = import_messages.prepare if self.messages else prepare
        self.rows = prep(rows, self.path, self.iteration)  # bad files fail first
        self.policy = sampling_policy(self.cfg, self.iteration)
        self.fingerprints = {
            "file": file_fingerprint(self.path),
            "policy": model_fingerprint(self.policy, f"policy of iteration {self.iteration}"),
        }

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "import": str(self.path.resolve()), "policy": self.policy}

    def plan(self) -> int:
        return math.ceil(self.rows.num_rows / self.cfg.score.rows_per_part)

    def progress_total(self, todo: list[int]) -> int:
        per_part = self.cfg.score.rows_per_part
        return sum(min(per_part, self.rows.num_rows - n * per_part) for n in todo)

    def open(self, todo: list[int]) -> None:
        cfg = self.cfg
        self.tok = load_tokenizer(self.policy, cfg.trust_remote_code)
        self.model = load_model(
            self.policy,
            f"policy of iteration {self.iteration}",
            device=dist.stage_device(cfg.device),
            dtype=cfg.dtype,
            trust_remote_code=cfg.trust_remote_code,
        )

    def write_part(self, n: int, bar: Any) -> Part:
        per_part = self.cfg.score.rows_per_part
        part = self.rows.slice(n * per_part, per_part)
        check_text_bound(part, self.messages, self.tok, positions_of(self.model), str(self.path))
        if self.messages:
            args = (part, self.tok, self.model, self.cfg, self.policy, self.path, n * per_part)
            table, counts = import_messages.tokenize_part(*args)
        else:
            table, counts = tokenize_part(part, self.tok, self.model, self.cfg, self.policy, str(self.path))
        bar.update(part.num_rows)
        tokens = list_tokens(table, "prompt_ids", "response_ids")
        return Part(
            table, with_extra(ROLLOUTS, table.schema if self.messages else self.rows.schema), counts, tokens
        )

    def manifest_extra(self) -> dict[str, Any]:
        return {"source": str(self.path.resolve()), **sampled_by(self.cfg, self.iteration)}


def import_rollouts(
    cfg: Config, file: str | Path, iteration: int, *, force: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Write iter=`iteration`/rollouts from `file`; returns the manifest (existing one if complete)."""
    return execute(Import(cfg, iteration, file), force=force, quiet=quiet)


def read_rows(path: Path) -> pa.Table:
    if not path.is_file():
        raise StageError(f"{path}: file not found")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".ndjson", ".parquet"):
        raise ConfigError(f"{path}: expected a .jsonl or .parquet file")
    try:
        if suffix == ".parquet":
            return pq.read_table(path)
        t = pajson.read_json(path, read_options=pajson.ReadOptions(block_size=1 << 26))
    except pa.ArrowInvalid as e:
        if suffix == ".parquet":
            raise SchemaError(f"{path}: cannot read ({str(e).splitlines()[0]})") from None
        t = _read_json_rows(path, e)  # e.g. tool-call arguments as strings and as objects
    except OSError as e:
        raise SchemaError(f"{path}: cannot read ({str(e).splitlines()[0]})") from None
    try:
        t.validate(full=True)  # Arrow's JSON reader does not check that strings are UTF-8
    except pa.ArrowInvalid:
        raise SchemaError(f"{path}: not UTF-8 text (JSON Lines must be UTF-8)") from None
    return t


def _read_json_rows(path: Path, first: Exception) -> pa.Table:
    """JSON Lines that Arrow's reader refuses because a column changes type between rows, as the
    docs allow for message trajectories: tool-call `arguments` as JSON strings in some rows and
    objects in others, `tools` as names in some and schemas in others. Read row by row, those
    become JSON strings (what the import reads them as); anything else still mixed is one line."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SchemaError(f"{path}: line {n}: not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise SchemaError(f"{path}: line {n}: not a JSON object")
                rows.append(_as_strings(row))
    except UnicodeDecodeError:
        raise SchemaError(f"{path}: not UTF-8 text (JSON Lines must be UTF-8)") from None
    try:
        return pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise SchemaError(f"{path}: cannot read ({str(first).splitlines()[0]})") from None


def _as_strings(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its tool-call arguments and its `tools` as JSON strings (strings kept)."""
    as_json = lambda v: v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False)  # noqa: E731
    if "tools" in row:
        row["tools"] = as_json(row["tools"])
    messages = row.get("messages")
    for m in messages if isinstance(messages, list) else []:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        for c in calls if isinstance(calls, list) else []:
            f = c.get("function") if isinstance(c, dict) else None
            if isinstance(f, dict) and "arguments" in f:
                f["arguments"] = as_json(f["arguments"])
    return row


def prepare(t: pa.Table, path: Path, iteration: int) -> pa.Table:
    """Check the columns; add rollout_id, prompt_id, sample_idx and finish_reason (file order)."""
    for name in ("prompt", "response"):
        if name not in t.column_names:
            raise SchemaError(
                f"{path}: missing column '{name}' (needs prompt and response; prompt_id optional)"
            )
        typ = t.schema.field(name).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise SchemaError(f"{path}: column '{name}' has type {typ}, expected string")
        no_nulls(t[name], path, name)
    if "behavior_logprobs" in t.column_names and "response_ids" not in t.column_names:
        raise SchemaError(f"{path}: column 'behavior_logprobs' needs the 'response_ids' it scores")
    for name, test in (("response_ids", pa.types.is_integer), ("behavior_logprobs", pa.types.is_floating)):
        if name in t.column_names:
            typ = t.schema.field(name).type
            if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not test(typ.value_type):
                raise SchemaError(f"{path}: column '{name}' has type {typ}, expected a list of numbers")
            no_nulls(t[name], path, name)
    clash = sorted(c for c in t.column_names if c in COMPUTED)
    if clash:
        raise SchemaError(f"{path}: column '{clash[0]}' is computed by import; rename or drop it")
    return add_ids(t, t["prompt"].to_pylist(), path, iteration)


def tokenize_part(
    t: pa.Table, tok: Any, model: Any, cfg: Config, policy: str, where: str
) -> tuple[pa.Table, dict[str, int]]:
    """Token ids (EOS appended to complete responses) and behaviour log-probs of one part."""
    rid, finish = t["rollout_id"].to_pylist(), t["finish_reason"].to_pylist()
    prompt_ids = tok(t["prompt"].to_pylist())["input_ids"]
    given = "response_ids" in t.column_names
    appended = 0
    if given:
        response_ids = t["response_ids"].to_pylist()
        check_given_ids(response_ids, rid, int(model.config.vocab_size), where)
    else:
        response_ids = tok(t["response"].to_pylist(), add_special_tokens=False)["input_ids"]
        for ids, f in zip(response_ids, finish, strict=True):
            if f == "stop" and (not ids or ids[-1] != tok.eos_token_id):
                ids.append(tok.eos_token_id)
                appended += 1
    for i in range(len(rid)):
        if not prompt_ids[i] or not response_ids[i]:
            what = "prompt" if not prompt_ids[i] else "response"
            raise SchemaError(f"{where}: rollout {rid[i]}: the {what} has no tokens")
    check_positions(prompt_ids, response_ids, rid, positions_of(model), where)
    if "behavior_logprobs" in t.column_names:
        logps = [np.asarray(lp, np.float64) for lp in t["behavior_logprobs"].to_pylist()]
        check_given_logprobs(logps, response_ids, rid, where)
    else:
        logps = batched_logprobs(
            model,
            prompt_ids,
            response_ids,
            cfg.generate.temperature,
            pad_id=int(tok.pad_token_id),
            max_tokens=cfg.score.max_tokens_per_batch,
        )
    t = t.drop_columns([c for c in GIVEN if c in t.column_names])
    t = t.append_column("prompt_ids", pa.array(prompt_ids, TOKENS))
    t = t.append_column("response_ids", pa.array(response_ids, TOKENS))
    t = t.append_column("behavior_logprobs", pa.array([lp.tolist() for lp in logps], LOGPROBS))
    t = t.append_column("policy", pa.array([layout.in_run(policy, cfg.run_dir)] * len(rid), pa.string()))
    counts = {"rows": len(rid), "tokens": sum(len(r) for r in response_ids), "eos_appended": appended}
    return t, counts


def check_text_bound(t: pa.Table, messages: bool, tok: Any, positions: int | None, where: str) -> None:
    """Refuse, before tokenising it, a row whose text could not fit the policy's positions: no
    token covers more characters than twice its own text's length (a normaliser may join two
    characters into one), so a text longer than positions x that has more tokens than positions.
    Tokenising a text of tens of megabytes would take many times its size in memory."""
    if not positions:
        return
    limit = positions * 2 * max((len(v) for v in tok.get_vocab()), default=1)
    if messages:
        texts = [
            sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
            for msgs in t[import_messages.MESSAGES].to_pylist()
        ]
    else:
        texts = [
            len(p) + len(r) for p, r in zip(t["prompt"].to_pylist(), t["response"].to_pylist(), strict=True)
        ]
    for rid, chars in zip(t["rollout_id"].to_pylist(), texts, strict=True):
        if chars > limit:
            raise SchemaError(
                f"{where}: rollout {rid}: {chars} characters of text, more than the policy's {positions} "
                "positions can hold (max_position_embeddings); shorten or drop it"
            )
