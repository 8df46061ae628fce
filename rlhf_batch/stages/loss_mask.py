"""The `loss_mask` column of multi-turn rollouts, as score, advantage and train read it
(core/masking.py holds the math). A table without the column, or a null row, is all ones: None
stands for "every response token was sampled", and the callers then run their single-turn code."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlhf_batch.errors import StageError

COLUMN = "loss_mask"


def flat_mask(table: Any, lengths: np.ndarray) -> np.ndarray | None:
    """[N] bool over the flat response tokens of `table` (row i holds `lengths[i]`), or None when
    the table has no loss mask or every value in it is 1."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if COLUMN not in table.column_names:
        return None
    col = table.column(COLUMN).combine_chunks()
    n_mask = pc.fill_null(pc.list_value_length(col), -1).to_numpy()  # [B], -1: null (all ones)
    values = pc.list_flatten(col)
    bad = ((n_mask >= 0) & (n_mask != lengths)).nonzero()[0]
    if bad.size or pc.all(pc.is_in(values, pa.array([0, 1], values.type))).as_py() not in (True, None):
        i = (
            int(bad[0])
            if bad.size
            else next(k for k, m in enumerate(col.to_pylist()) if m and set(m) - {0, 1})
        )
        rid = table.column("rollout_id")[i].as_py() if "rollout_id" in table.column_names else i
        what = (
            f"has {n_mask[i]} values for {lengths[i]} response tokens"
            if bad.size
            else "holds a value other than 0 and 1"
        )
        raise StageError(f"rollout {rid}: column '{COLUMN}' {what}")
    if pc.all(pc.equal(values, 1)).as_py() is not False:
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
