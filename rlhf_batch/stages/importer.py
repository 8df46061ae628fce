"""``rlhf-batch import FILE``: externally produced (prompt, response) rows -> ``iter=K/rollouts``.

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
* Parts of ``score.rows_per_part`` rows in file order, forward batches of
  ``score.max_tokens_per_batch`` tokens (import feeds score, and shares its batching knobs).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from rlhf_batch.config import Config
from rlhf_batch.errors import ConfigError, SchemaError, StageError
from rlhf_batch.models.forward import batched_logprobs
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.models.policy import sampled_by, sampling_policy
from rlhf_batch.runtime import dist
from rlhf_batch.stages.base import Part, Stage, list_tokens
from rlhf_batch.stages.executor import execute
from rlhf_batch.store import layout
from rlhf_batch.store.ids import prompt_hash, rollout_id
from rlhf_batch.store.manifests import file_fingerprint
from rlhf_batch.store.modeldir import model_fingerprint
from rlhf_batch.store.schemas import LOGPROBS, ROLLOUTS, TOKENS, with_extra

GIVEN = ("response_ids", "behavior_logprobs")  # an external engine's tokens and log-probs
COMPUTED = set(ROLLOUTS.names) - {"prompt", "response", "prompt_id", "finish_reason", *GIVEN}


class Import(Stage):
    """Rollouts from a file instead of generate: parts of `score.rows_per_part` rows in file order."""

    name, folder, unit, in_pipeline = "import", layout.ROLLOUTS, "row", False

    def __init__(self, cfg: Config, iteration: int, file: str | Path):
        super().__init__(cfg, iteration)
        self.path: Path = Path(file)
        self.rows: pa.Table  # prepare(): the file's rows, checked
        self.policy: str  # prepare(): the policy the rows are said to be sampled from
        self.tok: Any  # open(): the policy's tokenizer
        self.model: Any  # open(): the policy (behaviour log-probs of rows without them)

    def prepare(self) -> None:
        self.rows = prepare(read_rows(self.path), self.path, self.iteration)  # bad files fail first
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
        table, counts = tokenize_part(part, self.tok, self.model, self.cfg, self.policy, str(self.path))
        bar.update(part.num_rows)
        tokens = list_tokens(table, "prompt_ids", "response_ids")
        return Part(table, with_extra(ROLLOUTS, self.rows.schema), counts, tokens)

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
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaError(f"{path}: cannot read ({str(e).splitlines()[0]})") from None
    try:
        t.validate(full=True)  # Arrow's JSON reader does not check that strings are UTF-8
    except pa.ArrowInvalid:
        raise SchemaError(f"{path}: not UTF-8 text (JSON Lines must be UTF-8)") from None
    return t


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
        _no_nulls(t[name], path, name)
    if "behavior_logprobs" in t.column_names and "response_ids" not in t.column_names:
        raise SchemaError(f"{path}: column 'behavior_logprobs' needs the 'response_ids' it scores")
    for name, test in (("response_ids", pa.types.is_integer), ("behavior_logprobs", pa.types.is_floating)):
        if name in t.column_names:
            typ = t.schema.field(name).type
            if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not test(typ.value_type):
                raise SchemaError(f"{path}: column '{name}' has type {typ}, expected a list of numbers")
            _no_nulls(t[name], path, name)
    clash = sorted(c for c in t.column_names if c in COMPUTED)
    if clash:
        raise SchemaError(f"{path}: column '{clash[0]}' is computed by import; rename or drop it")
    prompts = t["prompt"].to_pylist()
    given = (
        t["prompt_id"].cast(pa.string()).to_pylist()
        if "prompt_id" in t.column_names
        else [None] * len(prompts)
    )
    ids = [g if g is not None else prompt_hash(p) for g, p in zip(given, prompts, strict=True)]
    first: dict[str, tuple[int, str]] = {}
    seen: dict[str, int] = {}
    sample_idx = []
    for row, (pid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        r0, p0 = first.setdefault(pid, (row, prompt))
        if p0 != prompt:
            raise SchemaError(
                f"{path}: prompt_id {pid!r} has different prompts in rows {r0 + 1} and {row + 1}"
            )
        sample_idx.append(seen.get(pid, 0))
        seen[pid] = sample_idx[-1] + 1
    finish = ["stop"] * len(prompts)
    if "finish_reason" in t.column_names:
        finish = [f or "stop" for f in t["finish_reason"].cast(pa.string()).to_pylist()]
        bad = [i for i, f in enumerate(finish) if f not in ("stop", "length")]
        if bad:
            raise SchemaError(
                f"{path}: column 'finish_reason' is {finish[bad[0]]!r} in row {bad[0] + 1}; "
                "expected 'stop' or 'length'"
            )
    out = t.drop_columns([c for c in ("prompt_id", "finish_reason") if c in t.column_names])
    out = out.append_column(
        "rollout_id", pa.array([rollout_id(iteration, p, k) for p, k in zip(ids, sample_idx, strict=True)])
    )
    out = out.append_column("prompt_id", pa.array(ids, pa.string()))
    out = out.append_column("sample_idx", pa.array(sample_idx, pa.int32()))
    return out.append_column("finish_reason", pa.array(finish, pa.string()))


def _no_nulls(col: pa.ChunkedArray, path: Path, name: str) -> None:
    """No null in the column, nor inside a list of it (errors name the row, 1-based)."""
    if col.null_count:
        row = pc.index(col.is_null(), True).as_py()
        raise SchemaError(f"{path}: column '{name}' is null in row {row + 1}")
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        inner = pc.list_flatten(col)
        if inner.null_count:
            row = pc.list_parent_indices(col)[pc.index(inner.is_null(), True).as_py()].as_py()
            raise SchemaError(f"{path}: column '{name}' holds a null value in row {row + 1}")


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
        _check_given_ids(response_ids, rid, int(model.config.vocab_size), where)
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
    if "behavior_logprobs" in t.column_names:
        logps = [np.asarray(lp, np.float64) for lp in t["behavior_logprobs"].to_pylist()]
        _check_given_logprobs(logps, response_ids, rid, where)
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


def _check_given_ids(response_ids: list[list[int]], rid: list[str], vocab: int, where: str) -> None:
    for r, ids in zip(rid, response_ids, strict=True):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise SchemaError(
                f"{where}: rollout {r}: response_ids holds {bad[0]}, outside the policy's vocabulary [0, {vocab})"
            )


def _check_given_logprobs(
    logps: list[Any], response_ids: list[list[int]], rid: list[str], where: str
) -> None:
    for r, lp, ids in zip(rid, logps, response_ids, strict=True):
        if len(lp) != len(ids):
            raise SchemaError(
                f"{where}: rollout {r}: behavior_logprobs has {len(lp)} values for {len(ids)} response_ids"
            )
        low = float(np.finfo(np.float32).min)  # stored as float32: below it would be -inf
        if not np.isfinite(lp).all() or (lp > 0).any() or (lp < low).any():
            bad = next(x for x in lp.tolist() if not math.isfinite(x) or x > 0 or x < low)
            raise SchemaError(
                f"{where}: rollout {r}: behavior_logprobs holds {bad}; log-probs are finite float32 "
                "values <= 0"
            )
