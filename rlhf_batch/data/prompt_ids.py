"""The prompt id of every row of a prompt set, decided over the whole file (never one batch).

* `generate.id_column` names the column whose values are the prompt ids; a dotted name reads a
  field of a struct column (verl's ``extra_info.index``). The default, ``id``, is used when the
  file has it; any other name that the file lacks is an error. Ids must be non-null, non-empty
  and distinct: an error names the file and the two file rows (0-based, in file order).
* Without an id column, a row's id is a hash of its rendered prompt (`ids.prompt_hash`). A prompt
  text that repeats (as TRL and verl allow) keeps the plain hash for its first row; its k-th
  repeat in file order (k = 1, 2, ...) gets ``<hash>-<k>``. Each row is then its own prompt with
  its own group, and the ids depend only on the file, so they are the same in every batch and
  on every resume.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from rlhf_batch.errors import StageError
from rlhf_batch.store.ids import prompt_hash

DEFAULT_ID_COLUMN = "id"


def find_column(table: pa.Table, name: str) -> pa.ChunkedArray | None:
    """Column `name`, or the struct field a dotted name points to (``extra_info.index``); None when
    the table has neither."""
    if not name:
        return None
    if name in table.column_names:
        return table.column(name)
    head, _, rest = name.partition(".")
    if not rest or head not in table.column_names:
        return None
    import pyarrow.compute as pc

    col: Any = table.column(head)
    for part in rest.split("."):
        if not pa.types.is_struct(col.type) or col.type.get_field_index(part) < 0:
            return None
        col = pc.struct_field(col, part)
    return col


def given_ids(table: pa.Table, id_column: str, where: str) -> list[str] | None:
    """The ids of the id column (checked: present when named, non-null, non-empty, distinct), or
    None when the prompt ids are hashes of the prompts."""
    col = find_column(table, id_column)
    if col is None:
        if id_column and id_column != DEFAULT_ID_COLUMN:
            raise StageError(
                f"{where}: generate.id_column '{id_column}' is not a column "
                f'(columns: {", ".join(table.column_names)}); set it to one, or to "" to use prompt hashes'
            )
        return None
    ids = [None if v is None else str(v) for v in col.to_pylist()]
    seen: dict[str, int] = {}
    for i, pid in enumerate(ids):
        if not pid:
            raise StageError(f"{where}: row {i}: id column '{id_column}' is null or empty")
        if pid in seen:
            raise StageError(
                f"{where}: rows {seen[pid]} and {i} have the same id '{pid}' in id column '{id_column}'; "
                'ids must be distinct (fix the data, or set generate.id_column = "" to use prompt hashes)'
            )
        seen[pid] = i
    return ids  # type: ignore[return-value]


def repeat_numbers(values: list[Any]) -> list[int]:
    """For each row, how many earlier rows hold the same prompt value (0: the first)."""
    count: dict[str, int] = {}
    out = []
    for v in values:
        key = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
        out.append(count.get(key, 0))
        count[key] = out[-1] + 1
    return out


def hashed_id(text: str, repeat: int) -> str:
    """The id of a row without an id column: the prompt's hash, ``-k`` for its k-th repeat."""
    return prompt_hash(text) if repeat == 0 else f"{prompt_hash(text)}-{repeat}"


def check_distinct(ids: list[str], rows: list[int], where: str) -> None:
    """Two rows with one id (two different prompt values rendered to the same text): an error
    naming their file rows."""
    seen: dict[str, int] = {}
    for pid, row in zip(ids, rows, strict=True):
        if pid in seen:
            raise StageError(
                f"{where}: rows {seen[pid]} and {row} render to the same prompt (prompt_id {pid}); "
                "give the file an id column (generate.id_column)"
            )
        seen[pid] = row
