"""Run health: each trained iteration's train diagnostics against documented thresholds.

The rule is one SQL query, rlhf_batch/sql/health.sql, over the `metrics` view (one row per
optimizer step): median clip fraction, the share of steps whose ESS is low, the fall of the mean
entropy from the previous trained iteration, and the largest step KL between the policy that
sampled and the one being trained. `sql` has it as the view `health`; `status`, the report and
`run` read it from there. The thresholds and their sources are in docs/inspecting.md "Run health".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_batch.sql import sql_text

HINT = 'rlhf-batch sql "SELECT * FROM health"'
# The thresholds (docs/inspecting.md "Run health" gives the source of each). An iteration is flagged when:
THRESHOLDS = {
    "clip_fraction": 0.2,  # the median clip fraction of its optimizer steps is above this
    "ess": 0.5,  # a step's ESS (of the sequences' importance weights, over n) is below this ...
    "low_ess_share": 0.5,  # ... on more than this share of its steps
    "entropy_fall": 0.5,  # its mean entropy fell by more than this share of the previous iteration's
    "kl_approx": 0.1,  # a step's kl_approx (KL sampling policy -> trained policy, k3) is above this
}


def view_sql(tis_masked: bool = True) -> str:
    """The health query (sql/health.sql) with THRESHOLDS written in; it reads a `metrics` view
    (`tis_masked`: whether that view has the column, which metrics written before it lack)."""
    text = sql_text("health").replace("{tis_masked}", "tis_masked" if tis_masked else "NULL::DOUBLE")
    for name, value in THRESHOLDS.items():
        text = text.replace("{" + name + "}", repr(float(value)))
    return text


def create_view(con: Any) -> None:
    """The view `health` over the connection's `metrics` view."""
    names = [d[0] for d in con.execute("SELECT * FROM metrics LIMIT 0").description]
    con.execute("CREATE VIEW health AS " + view_sql("tis_masked" in names))


def rows(con: Any) -> list[dict[str, Any]]:
    """The health view's rows (a connection from `query.connect`), one per trained iteration."""
    cur = con.execute("SELECT * FROM health")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def iteration_warning(run_dir: str | Path, it: int) -> str | None:
    """The warning of iteration `it` (its train complete), None when it crosses no threshold.
    Reads only its metrics and those of the last trained iteration before it (the entropy fall)."""
    import duckdb

    from rlhf_batch.sql import quote
    from rlhf_batch.store import fs

    run = fs.run_path(run_dir)
    files = _metrics_files(run, it)
    if not files:
        return None
    con = duckdb.connect(":memory:")
    try:
        fs.register(con, run)  # a run on an object store
        con.execute(
            f"CREATE VIEW metrics AS SELECT * FROM read_parquet([{', '.join(map(quote, files))}], "
            "hive_partitioning = true, hive_types = {'iter': INTEGER})"
        )
        create_view(con)
        found = [r["warning"] for r in rows(con) if r["iter"] == it]
    finally:
        con.close()
    return found[0] or None if found else None


def _metrics_files(run: Path, it: int) -> list[str]:
    """Iteration `it`'s complete train metrics and those of the last earlier iteration that
    trained a step (its manifest's `rows`), oldest first; [] when `it`'s are missing or empty."""
    from rlhf_batch.store import layout, manifests

    out: list[str] = []
    for k in range(it, -1, -1):
        sdir = layout.folder(run, k, "train")
        m = manifests.manifest(sdir)
        if m is not None and m.get("rows"):
            out.insert(0, str(sdir / layout.METRICS_FILE))
        elif k == it:
            return []
        if len(out) == 2:
            break
    return out


def warning_line(it: int, warning: str) -> str:
    return f"warning: iteration {it} train health: {warning} ({HINT})"
