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
from rlhf_batch.data.mixtures import is_mixture, source_sizes, take, with_source
from rlhf_batch.data.prompt_files import concat, describe, read_file, read_prompt_table, sources
from rlhf_batch.data.prompt_ids import check_distinct, given_ids, hashed_id, repeat_numbers
from rlhf_batch.errors import StageError, UserError
from rlhf_batch.store.schemas import ROLLOUTS


@dataclass
class Prompts:
    ids: list[str]  # prompt_id per prompt
    texts: list[str]  # rendered prompt text
    tokens: list[list[int]]  # prompt token ids
    carried: pa.Table  # the other columns, one row per prompt
    counts: dict[str, int] = field(default_factory=dict)  # skipped / truncated prompts
    batch: dict[str, Any] = field(default_factory=dict)  # the batch index, epoch and positions taken
    # the prompt file's own names of the id and chat columns ("": none), which an environment's
    # row (generate.environment) holds beside `prompt_id` and `prompt_messages`
    id_column: str = ""
    chat_column: str = ""


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
    table, problems = prompt_set_problems(cfg)
    if problems:
        more = (
            f" (and {len(problems) - 1} more problems: `rlhf-batch validate` lists them)"
            if problems[1:]
            else ""
        )
        raise StageError(problems[0] + more)
    assert table is not None
    where = describe(cfg.prompts)
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
    tokens = tokenizer(texts, add_special_tokens=not chat)["input_ids"]
    out = _limit(Prompts(ids, texts, tokens, carried), cfg, tokenizer, where, rows)
    out.batch = taken
    out.id_column = cfg.id_column if given is not None and cfg.id_column in table.column_names else ""
    column = chat_column(table, cfg)
    out.chat_column = column if column and column != cfg.prompt_column else ""
    return out


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # others: rendered wrong, or not at all
MAX_ROW_PROBLEMS = 10  # rows named one by one; the rest counted


def prompt_set_problems(
    cfg: GenerateConfig, key: str = "generate.prompts"
) -> tuple[pa.Table | None, list[str]]:
    """Every problem `generate` refuses the prompt set `cfg.prompts` for, before tokenizing (one
    line each; `validate` lists them all, generate stops at the first): each source readable and
    not empty, all sources of one form (text or chat), then over the whole set a prompt column,
    no null or empty prompt, well-formed chat messages with known roles, good ids, no column
    that clashes with a rollouts column. Also the set as one table (None when a source fails)."""
    paths = sources(cfg.prompts, key)
    problems: list[str] = []
    tables: list[pa.Table] = []
    forms: dict[str, Path] = {}  # form -> its first source
    for p in paths:
        try:
            t = read_file(p)
        except UserError as e:
            problems.append(str(e))
            continue
        tables.append(t)
        if t.num_rows == 0:
            problems.append(f"{p}: the prompt file is empty")
        else:
            forms.setdefault("chat" if chat_column(t, cfg) else "text", p)
    if len(forms) > 1:
        problems.append(
            f"{forms['chat']}: chat prompts, while {forms['text']} holds text prompts; a prompt set is of one form"
        )
    if problems:
        return None, problems
    where = describe(cfg.prompts)
    try:
        table = concat(paths, tables)
        if is_mixture(cfg.prompts):  # weighted sources: a `source` column (mixtures.py)
            sizes = source_sizes(cfg.prompts, key, [t.num_rows for t in tables])
            table = with_source(table, cfg.prompts, sizes, where)
    except UserError as e:
        return None, [str(e)]
    problems = _row_problems(table, cfg, where)
    try:
        given_ids(table, cfg.id_column, where)
    except UserError as e:
        problems.append(str(e))
    if chat_column(table, cfg) or cfg.prompt_column in table.column_names:
        for name in carried_table(table, cfg).column_names:
            if ROLLOUTS.get_field_index(name) >= 0:
                problems.append(f"{where}: column '{name}' clashes with a rollouts column; rename it")
    return table, problems


def _row_problems(table: pa.Table, cfg: GenerateConfig, where: str) -> list[str]:
    """The prompt column's problems, one per bad row (the first MAX_ROW_PROBLEMS, then a count)."""
    chat = chat_column(table, cfg)
    if not chat and cfg.prompt_column not in table.column_names:
        return [str(no_prompt_column(table, cfg, where))]
    column = chat or cfg.prompt_column
    col = table.column(column)
    if not chat and not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return [
            f"{where}: column '{column}' must hold strings or chat messages (a list of {{role, content}}), "
            f"not {col.type}"
        ]
    check = _message_problem if chat else _text_problem
    bad = [
        f"{where}: row {i}: {problem}" for i, v in enumerate(col.to_pylist()) if (problem := check(v, column))
    ]
    if len(bad) > MAX_ROW_PROBLEMS:
        bad = [*bad[:MAX_ROW_PROBLEMS], f"{where}: {len(bad) - MAX_ROW_PROBLEMS} more rows like these"]
    return bad


def _text_problem(text: Any, column: str) -> str:
    return "" if text else f"column '{column}' is null or empty"


def _message_problem(messages: Any, column: str) -> str:
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return f"'{column}' must be a list of {{role, content}}"
    for j, m in enumerate(messages):
        if m["role"] is None:
            return f"message {j} of '{column}' has no role"
        if m["content"] is None:  # rendered as an empty turn otherwise
            return f"message {j} of '{column}' ({m['role']}) has null content"
        if m["role"] not in CHAT_ROLES:
            return f"message {j} of '{column}' has role {m['role']!r}; roles are {', '.join(CHAT_ROLES)}"
    return ""


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

    if is_mixture(cfg.prompts):  # per-source seeded quotas (mixtures.py)
        return take(table, cfg.prompts, cfg.prompts_per_iteration, batch, seed, where)
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
        return col.to_pylist(), False  # checked: prompt_set_problems
    raise no_prompt_column(table, cfg, where)


def no_prompt_column(table: pa.Table, cfg: GenerateConfig, where: str) -> StageError:
    return StageError(
        f"{where}: no '{cfg.prompt_column}' or '{cfg.messages_column}' column "
        f"(columns: {', '.join(table.column_names)}); set generate.prompt_column or generate.messages_column"
    )


def _chat_texts(table: pa.Table, column: str, tokenizer: Any, where: str, rows: list[int]) -> list[str]:
    if not getattr(tokenizer, "chat_template", None):
        raise StageError(f"{where}: chat prompts ('{column}') need a tokenizer with a chat template")
    from rlhf_batch.envs.tools import template_tools

    tools = table.column("tools").to_pylist() if "tools" in table.column_names else [None] * table.num_rows
    out = []
    for k, (messages, tl) in enumerate(zip(table.column(column).to_pylist(), tools, strict=True)):
        try:  # a row's tools (schemas, or built-in tool names) render in the template's tools block
            schemas = template_tools(tl)
        except ValueError as e:
            raise StageError(f"{where}: row {rows[k] if k < len(rows) else k}: column 'tools': {e}") from None
        out.append(  # the messages are checked: prompt_set_problems
            tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
        )
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
