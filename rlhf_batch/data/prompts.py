"""Prompt sets (files, lists, globs, shard directories, hub datasets: prompt_files.py) as prompts.

A prompt is a text column (`prompt`) or a chat column (`messages`: a list of {role, content},
rendered with the tokenizer's chat template and the generation prompt). A `prompt` column that
holds messages (TRL's conversational form, verl's Parquet) is read as chat: the form comes from
the column's type. Chat prompts are carried into the rollouts as `prompt_messages`.
`prompt_id` comes from the id column (a dotted name reads a struct field: `extra_info.index`),
or is a hash of the rendered prompt; a repeated prompt is its own prompt (prompt_ids.py). Every other column
is carried along into the rollouts for reward functions (e.g. a ground-truth `answer`); a
verl `reward_model` struct also gives its `ground_truth` field as a column of that name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlhf_batch.config import Config, GenerateConfig
from rlhf_batch.data.prompt_files import describe, read_prompt_table, sources
from rlhf_batch.data.prompt_ids import check_distinct, given_ids, hashed_id, repeat_numbers
from rlhf_batch.errors import StageError
from rlhf_batch.store.schemas import ROLLOUTS


@dataclass
class Prompts:
    ids: list[str]  # prompt_id per prompt
    texts: list[str]  # rendered prompt text
    tokens: list[list[int]]  # prompt token ids
    carried: pa.Table  # the other columns, one row per prompt
    counts: dict[str, int] = field(default_factory=dict)  # skipped / truncated prompts
    batch: dict[str, Any] = field(default_factory=dict)  # the batch index, epoch and positions taken


def check_path(spec: Any, key: str = "generate.prompts") -> list[Path]:
    """The sources of the configured prompt set, which must exist (prompt_files.sources)."""
    return sources(spec, key)


def read_table(spec: Any) -> pa.Table:
    """The prompt set as one Arrow table (prompt_files.py); errors name the file."""
    return read_prompt_table(spec)


def load_prompts(cfg: GenerateConfig, tokenizer: Any, batch: int | None = None, seed: int = 0) -> Prompts:
    """The prompts of the file, or (`batch` given) those of batch `batch` of the run's prompt order
    (iteration K's round 0 takes batch K unless top-up rounds took batches before it: topup.py).
    Prompt ids are decided over the whole file (prompt_ids.py); errors name file rows."""
    table = read_table(cfg.prompts)
    where = describe(cfg.prompts)
    if table.num_rows == 0:
        raise StageError(f"{where}: the prompt file is empty")
    given = given_ids(table, cfg.id_column, where)
    repeats = None if given is not None else repeat_numbers(prompt_values(table, cfg, where))
    taken: dict[str, Any] = {}
    rows = list(range(table.num_rows))
    if batch is not None:
        table, taken = _take_batch(table, cfg, batch, seed, where)
        rows = taken["rows"]
    texts, chat = _texts(table, cfg, tokenizer, where, rows)
    if given is not None:
        ids = [given[r] for r in rows]
    else:
        assert repeats is not None
        ids = [hashed_id(t, repeats[r]) for t, r in zip(texts, rows, strict=True)]
    check_distinct(ids, rows, where)
    carried = carried_table(table, cfg)
    for name in carried.column_names:
        if ROLLOUTS.get_field_index(name) >= 0:
            raise StageError(f"{where}: column '{name}' clashes with a rollouts column; rename it")
    tokens = tokenizer(texts, add_special_tokens=not chat)["input_ids"]
    out = _limit(Prompts(ids, texts, tokens, carried), cfg, tokenizer, where, rows)
    out.batch = taken
    return out


def carried_table(table: pa.Table, cfg: GenerateConfig) -> pa.Table:
    """The columns carried into the rollouts (what reward functions see): every column but the
    prompt and id columns, verl's `ground_truth`, and chat prompts' messages as `prompt_messages`."""
    used = {cfg.prompt_column, cfg.messages_column, cfg.id_column}
    carried = with_ground_truth(table.drop_columns([c for c in table.column_names if c in used]))
    if (chat := chat_column(table, cfg)) and MESSAGES not in carried.column_names:
        carried = carried.append_column(MESSAGES, table.column(chat))
    return carried


def prompt_values(table: pa.Table, cfg: GenerateConfig, where: str) -> list[Any]:
    """The raw prompt of every row (text, or the list of messages), before any rendering."""
    column = chat_column(table, cfg) or (cfg.prompt_column if cfg.prompt_column in table.column_names else "")
    if not column:
        raise no_prompt_column(table, cfg, where)
    return table.column(column).to_pylist()


def _take_batch(
    table: pa.Table, cfg: GenerateConfig, batch: int, seed: int, where: str
) -> tuple[pa.Table, dict[str, Any]]:
    """The rows batch `batch` takes (core.prompt_batches) and what the manifest records."""
    from rlhf_batch.core.prompt_batches import rows_for

    try:
        b, rows = rows_for(batch, table.num_rows, cfg.prompts_per_iteration, seed)
    except ValueError as e:
        raise StageError(f"{where}: generate.prompts_per_iteration: {e}") from None
    info = {
        "batch": batch,
        "epoch": b.epoch,
        "positions": [b.start, b.stop],
        "rows": rows,
        "prompts_in_set": table.num_rows,
    }
    return (table if cfg.prompts_per_iteration == 0 else table.take(pa.array(rows, pa.int64()))), info


def run_iterations(cfg: Config) -> int:
    """The run's number of iterations: `iterations`, or `epochs` passes over the prompt set."""
    if cfg.epochs == 0:
        return cfg.iterations
    from rlhf_batch.core.prompt_batches import iterations_per_epoch

    n = read_table(cfg.generate.prompts).num_rows
    try:
        return cfg.epochs * iterations_per_epoch(n, cfg.generate.prompts_per_iteration)
    except ValueError as e:
        raise StageError(f"{describe(cfg.generate.prompts)}: generate.prompts_per_iteration: {e}") from None


MESSAGES = "prompt_messages"  # the rollouts column that carries chat prompts' messages


def is_messages_type(typ: pa.DataType) -> bool:
    """list<struct<...>>: a column of chat messages (TRL's conversational form, verl's `prompt`)."""
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_struct(typ.value_type)


def chat_column(table: pa.Table, cfg: GenerateConfig) -> str:
    """The column holding chat prompts: `prompt_column` when its type is messages, else
    `messages_column` (when there is no text prompt column)."""
    if cfg.prompt_column in table.column_names:
        if is_messages_type(table.schema.field(cfg.prompt_column).type):
            return cfg.prompt_column
        return ""
    return cfg.messages_column if cfg.messages_column in table.column_names else ""


def with_ground_truth(table: pa.Table) -> pa.Table:
    """verl's `reward_model: {style, ground_truth}` also gives a `ground_truth` column."""
    if "ground_truth" in table.column_names or "reward_model" not in table.column_names:
        return table
    typ = table.schema.field("reward_model").type
    if not pa.types.is_struct(typ) or typ.get_field_index("ground_truth") < 0:
        return table
    import pyarrow.compute as pc

    return table.append_column("ground_truth", pc.struct_field(table.column("reward_model"), "ground_truth"))


def _texts(
    table: pa.Table, cfg: GenerateConfig, tokenizer: Any, where: str, rows: list[int]
) -> tuple[list[str], bool]:
    """The rendered prompts of `table`, whose rows are the file's rows `rows` (named in errors)."""
    chat = chat_column(table, cfg)
    if chat:
        return _chat_texts(table, chat, tokenizer, where, rows), True
    if cfg.prompt_column in table.column_names:
        col = table.column(cfg.prompt_column)
        if not pa.types.is_string(col.type) and not pa.types.is_large_string(col.type):
            raise StageError(
                f"{where}: column '{cfg.prompt_column}' must hold strings or chat messages "
                f"(a list of {{role, content}}), not {col.type}"
            )
        texts = col.to_pylist()
        for i, t in enumerate(texts):
            if t is None or not t:
                raise StageError(f"{where}: row {rows[i]}: column '{cfg.prompt_column}' is null or empty")
        return texts, False
    raise no_prompt_column(table, cfg, where)


def no_prompt_column(table: pa.Table, cfg: GenerateConfig, where: str) -> StageError:
    return StageError(
        f"{where}: no '{cfg.prompt_column}' or '{cfg.messages_column}' column "
        f"(columns: {', '.join(table.column_names)}); set generate.prompt_column or generate.messages_column"
    )


def _chat_texts(table: pa.Table, column: str, tokenizer: Any, where: str, rows: list[int]) -> list[str]:
    if not getattr(tokenizer, "chat_template", None):
        raise StageError(f"{where}: chat prompts ('{column}') need a tokenizer with a chat template")
    out = []
    for i, messages in enumerate(table.column(column).to_pylist()):
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise StageError(f"{where}: row {rows[i]}: '{column}' must be a list of {{role, content}}")
        for j, m in enumerate(messages):
            if m["content"] is None:  # rendered as an empty turn otherwise
                raise StageError(
                    f"{where}: row {rows[i]}: message {j} of '{column}' ({m['role']}) has null content"
                )
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def _limit(p: Prompts, cfg: GenerateConfig, tokenizer: Any, where: str, rows: list[int]) -> Prompts:
    """Apply max_prompt_tokens: error (default), truncate_left (the text becomes that of the kept
    tokens, so `prompt` and `prompt_ids` agree), or skip (counted)."""
    limit, keep, truncated = cfg.max_prompt_tokens, [], 0
    for i, toks in enumerate(p.tokens):
        if len(toks) <= limit:
            keep.append(i)
        elif cfg.overlong == "error":
            raise StageError(
                f"{where}: row {rows[i]} (prompt_id {p.ids[i]}) has {len(toks)} tokens > generate.max_prompt_tokens "
                f"= {limit}; raise it or set generate.overlong to 'truncate_left' or 'skip'"
            )
        elif cfg.overlong == "truncate_left":
            p.tokens[i] = toks[-limit:]
            p.texts[i] = tokenizer.decode(p.tokens[i])
            truncated += 1
            keep.append(i)
    skipped = len(p.tokens) - len(keep)
    if not keep:
        raise StageError(f"{where}: every prompt is longer than generate.max_prompt_tokens = {limit}")
    counts = {"prompts": len(keep), "prompts_skipped_overlong": skipped, "prompts_truncated": truncated}
    return Prompts(
        [p.ids[i] for i in keep],
        [p.texts[i] for i in keep],
        [p.tokens[i] for i in keep],
        p.carried.take(pa.array(keep, pa.int64())),
        counts,
    )
