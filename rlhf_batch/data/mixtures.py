"""Weighted prompt mixtures: `generate.prompts = [{path = ..., weight = ...}, ...]`.

Each entry is a prompt set of its own (`path`: any form generate reads, prompt_files.py), with
a `weight` > 0 and an optional `name` (default: the path as written). The sources are read in
order into one table, with a `source` column (the entry's name) that is carried into the
rollouts, so `sql` can group by it (the `source_stats` view; query.py). Prompt ids are decided
over the whole table as for a list of files (so they must be distinct across sources).

Batch k of the run's prompt order (iteration K's, or a top-up round's: topup.py) takes a
seeded quota of B = generate.prompts_per_iteration prompts from each source, from the source's
own per-epoch seeded order (core/mixtures.py). The rollouts manifest's `prompt_batch` records
each source's quota, epoch and positions (`sources`). A mixture needs B > 0. A single path,
or a list of paths, is read exactly as before.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import pyarrow as pa

from rlhf_batch.core.mixtures import names
from rlhf_batch.errors import StageError

SOURCE = "source"  # the column naming each prompt's source


def is_mixture(spec: Any) -> TypeGuard[list[dict[str, Any]]]:
    """A list of {path, weight} tables (not a path or a list of paths)."""
    return isinstance(spec, list) and any(isinstance(x, dict) for x in spec)


def weights(spec: list[dict[str, Any]]) -> list[float]:
    return [float(e["weight"]) for e in spec]


def identity(spec: list[dict[str, Any]]) -> dict[str, float]:
    """What generate's inputs record beside the files' content: each source's name and weight."""
    return dict(zip(names(spec), weights(spec), strict=True))


def with_source(table: pa.Table, spec: list[dict[str, Any]], sizes: list[int], where: str) -> pa.Table:
    """The concatenated set with its `source` column (`sizes`: the rows of each source)."""
    if SOURCE in table.column_names:
        raise StageError(f"{where}: column '{SOURCE}' clashes with the mixture's {SOURCE} column; rename it")
    labels = [n for n, size in zip(names(spec), sizes, strict=True) for _ in range(size)]
    return table.append_column(SOURCE, pa.array(labels, pa.string()))


def source_sizes(spec: list[dict[str, Any]], key: str, file_rows: list[int]) -> list[int]:
    """The rows of each source from the rows of each file (in reading order)."""
    from rlhf_batch.data.prompt_files import sources

    out, start = [], 0
    for e in spec:
        k = len(sources(e["path"], key))
        out.append(sum(file_rows[start : start + k]))
        start += k
    return out


def take(
    table: pa.Table, spec: list[dict[str, Any]], per_iteration: int, batch: int, seed: int, where: str
) -> tuple[pa.Table, dict[str, Any]]:
    """The rows batch `batch` takes of every source, and what the manifest's prompt_batch records."""
    from rlhf_batch.core.mixtures import rows_for

    labels = table.column(SOURCE).to_pylist()
    sizes = [labels.count(n) for n in names(spec)]
    try:
        got, rows = rows_for(batch, sizes, weights(spec), per_iteration, seed)
    except ValueError as e:
        raise StageError(f"{where}: generate.prompts: {e}") from None
    info = {
        "batch": batch,
        "rows": rows,
        "prompts_in_set": table.num_rows,
        "sources": {
            n: {"quota": t.quota, "epoch": t.epoch, "positions": [t.start, t.stop], "prompts_in_source": size}
            for n, t, size in zip(names(spec), got, sizes, strict=True)
        },
    }
    return table.take(pa.array(rows, pa.int64())), info
