"""The `loss_mask` column of multi-turn rollouts, as score, advantage and train read it
(core/masking.py holds the math). A table without the column, or a null row, is all ones: None
stands for "every response token was sampled", and the callers then run their single-turn code."""

from __future__ import annotations

from typing import Any

import numpy as np

COLUMN = "loss_mask"


def flat_mask(table: Any, lengths: np.ndarray) -> np.ndarray | None:
    """[N] bool over the flat response tokens of `table` (row i holds `lengths[i]`), or None when
    the table has no loss mask or every value in it is 1."""
    import pyarrow.compute as pc

    if COLUMN not in table.column_names:
        return None
    col = table.column(COLUMN).combine_chunks()
    if col.null_count == 0 and pc.all(pc.equal(pc.list_flatten(col), 1)).as_py() is not False:
        return None  # all ones (or empty): the single-turn path, bit for bit
    rows = [
        np.ones(int(n), bool) if m is None else np.asarray(m, bool)
        for m, n in zip(col.to_pylist(), lengths, strict=True)
    ]
    return np.concatenate(rows) if rows else np.zeros(0, bool)


def has_mask(folders: list[Any]) -> bool:
    """Whether a part of these complete folders (rollouts) has the column, from the footers."""
    from rlhf_batch.store import manifests

    for sdir in folders:
        for p in (manifests.manifest(sdir) or {}).get("parts", []):
            if manifests.parquet_file(sdir / p["file"]).schema_arrow.get_field_index(COLUMN) >= 0:
                return True
    return False
