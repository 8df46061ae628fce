"""Run health: each trained iteration's train diagnostics against documented thresholds.

The rule is one SQL query, rlhf_batch/sql/health.sql, over the `metrics` view (one row per
optimizer step): median clip fraction, the share of steps whose ESS is low, the fall of the mean
entropy from the previous trained iteration, and the largest step KL between the policy that
sampled and the one being trained. `sql` has it as the view `health`; `status`, the report and
`run` read it from there. The thresholds and their sources are in docs/inspecting.md "Run health".
"""

from __future__ import annotations

import json
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


def view_sql(tis_masked: bool = True, sequence_iters: frozenset[int] = frozenset()) -> str:
    """The health query (sql/health.sql) with THRESHOLDS written in; it reads a `metrics` view
    (`tis_masked`: whether that view has the column, which metrics written before it lack).
    `sequence_iters`: the iterations trained with sequence-level ratios (GSPO), whose clip
    fraction is the share of tokens in clipped rows at GSPO's clip range: the token-level PPO
    threshold does not apply to it (`sequence_iterations`)."""
    text = sql_text("health").replace("{tis_masked}", "tis_masked" if tis_masked else "NULL::DOUBLE")
    text = text.replace("{sequence_iters}", f"[{', '.join(map(str, sorted(sequence_iters)))}]::INTEGER[]")
    for name, value in THRESHOLDS.items():
        text = text.replace("{" + name + "}", repr(float(value)))
    return text


def create_view(con: Any, sequence_iters: frozenset[int] = frozenset()) -> None:
    """The view `health` over the connection's `metrics` view."""
    names = [d[0] for d in con.execute("SELECT * FROM metrics LIMIT 0").description]
    con.execute("CREATE VIEW health AS " + view_sql("tis_masked" in names, sequence_iters))


def sequence_iterations(run: Path, iterations: Any) -> frozenset[int]:
    """Those of `iterations` whose complete train ran with train.ratio_level = 'sequence' (its
    manifest's config; a key at its default is not written there: 'token')."""
    from rlhf_batch.store import layout
    from rlhf_batch.store.manifests import manifest_of

    out = set()
    for it in iterations:
        m = manifest_of(layout.folder(run, it, "train")) or {}
        if ((m.get("config") or {}).get("train") or {}).get("ratio_level") == "sequence":
            out.add(int(it))
    return frozenset(out)


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
        create_view(con, sequence_iterations(run, [it]))
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


REWARD_HINT = 'rlhf-batch sql "SELECT * FROM reward_health"'


def reward_warning_line(it: int, warning: str) -> str:
    return f"warning: iteration {it} reward health: {warning} ({REWARD_HINT})"


# Reward-hacking signatures (rlhf_batch/core/reward_health.py; docs/inspecting.md "Run health").
# Changes are in units of the pooled standard deviation of the two iterations' rollouts (z):
REWARD_THRESHOLDS = {
    "window": 3,  # iteration K is compared with the latest iteration <= K - 3 that has both signals
    "rise": 0.5,  # the score "rose": z(score) above this (Cohen's medium effect)
    "flat": 0.1,  # an audit column or eval correctness "stayed flat": its z below this
    "length_rise": 1.0,  # the mean response length "drifted": its z above this, with the score rising
    "dominant_share": 0.9,  # one reward part explains more than this share of reward_raw's variance
}
REWARD_VIEW = "reward_health"


def _moments(con: Any, sql: str, series: int = 1) -> list[dict[int, Any]]:
    """Per iteration, the Moments of each of `series` values, from one query whose rows are (iter,
    count, sum of the first value, sum of its squares, sum of the second, ...)."""
    from rlhf_batch.core.reward_health import Moments

    rows = [r for r in con.execute(sql).fetchall() if r[1]]
    return [
        {int(r[0]): Moments(int(r[1]), float(r[2 + 2 * k]), float(r[3 + 2 * k])) for r in rows}
        for k in range(series)
    ]


def _columns(con: Any, view: str) -> list[tuple[str, str]]:
    cur = con.execute(f"SELECT * FROM {view} LIMIT 0")
    names = [(d[0], str(d[1])) for d in cur.description]
    cur.fetchall()  # the result finished: the connection takes further work
    return names


def reward_signals(
    con: Any, manifests: list[tuple[int, str]] | None = None
) -> tuple[dict[str, dict[int, Any]], dict[int, dict[str, float | None]]]:
    """The per-iteration Moments of score, length, every float audit column and eval's correct,
    and each reward part's squared correlation with reward_raw (parts: the scores manifest's
    `unscored_<column>` counts), from the connection's views (`manifests`: (iter, scores manifest
    text) pairs, else the `stages` view's)."""
    import math

    from rlhf_batch.sql import quote_ident

    joined = (
        "FROM scores s JOIN rollouts r USING (iter, rollout_id) WHERE s.score IS NOT NULL GROUP BY s.iter"
    )
    score, length = _moments(  # one pass over the join for both
        con,
        "SELECT s.iter, count(*), sum(s.score), sum(s.score * s.score), "
        f"sum(len(r.response_ids)), sum(len(r.response_ids) ^ 2) {joined}",
        series=2,
    )
    series = {"score": score, "length": length}
    for col, kind in _columns(con, "audit"):
        if col.startswith("audit_") and kind in ("DOUBLE", "FLOAT"):
            c = quote_ident(col)
            series[col] = _moments(
                con, f"SELECT iter, count({c}), sum({c}), sum({c} * {c}) FROM audit GROUP BY iter"
            )[0]
    correct = (
        "SELECT iter, count(correct), sum(correct::DOUBLE), sum(correct::DOUBLE) FROM eval GROUP BY iter"
    )
    if found := _moments(con, correct)[0]:
        series["correct"] = found
    parts: dict[int, dict[str, float | None]] = {}
    if manifests is None:
        manifests = con.execute(
            "SELECT iter, manifest FROM stages WHERE stage = 'scores' AND topup = 0"
        ).fetchall()
    have = {c for c, _ in _columns(con, "scores")}
    wanted: dict[int, list[str]] = {}  # iteration -> its reward parts
    for it, text in manifests:
        counts = json.loads(text).get("counts") or {}
        cols = [k.removeprefix("unscored_") for k in counts if k.startswith("unscored_")]
        if cols := [c for c in cols if c in have]:
            wanted[int(it)] = cols
    if wanted:  # one query over every iteration, not one per iteration
        union = sorted({c for cols in wanted.values() for c in cols})
        exprs = ", ".join(f"corr({quote_ident(c)}, reward_raw)" for c in union)
        found = {
            int(row[0]): dict(zip(union, row[1:], strict=True))
            for row in con.execute(
                f"SELECT iter, {exprs} FROM scores WHERE reward_raw IS NOT NULL GROUP BY iter"
            ).fetchall()
        }
        for it, cols in wanted.items():
            r2 = {c: found.get(it, {}).get(c) for c in cols}  # no row with a reward_raw: null
            parts[it] = {c: (r * r if r is not None and math.isfinite(r) else None) for c, r in r2.items()}
    return series, parts


def register_reward_view(con: Any) -> None:
    """The table `reward_health` (one row per scored iteration: iter, score_mean, length_mean,
    flags, warning) computed now from the connection's views; `sql` does it when a query names it."""
    from rlhf_batch.core.reward_health import flags

    series, parts = reward_signals(con)
    found = flags(series, parts, REWARD_THRESHOLDS)
    its = sorted(found)
    columns = {  # as SQL values, not an Arrow table: handing DuckDB one imports pandas (~0.5 s)
        "iter": its,
        "score_mean": [series["score"][k].mean for k in its],
        "length_mean": [series["length"][k].mean for k in its],
        "flags": [[f for f, _ in found[k]] for k in its],
        "warning": ["; ".join(w for _, w in found[k]) for k in its],
    }
    types = {"iter": "INTEGER", "score_mean": "DOUBLE", "length_mean": "DOUBLE", "flags": "VARCHAR[]"}
    values = ", ".join(f"unnest(${c}::{types.get(c, 'VARCHAR')}[]) AS {c}" for c in columns)
    con.execute(f"CREATE OR REPLACE TABLE {REWARD_VIEW} AS SELECT {values}", columns)


def reward_warnings(con: Any) -> dict[int, str]:
    """The reward_health warning of every flagged iteration, computed now (`register_reward_view`)
    over a connection from `query.connect`: what `status` and `run` show."""
    register_reward_view(con)
    found = con.execute(f"SELECT iter, warning FROM {REWARD_VIEW} WHERE warning <> ''").fetchall()
    return {int(it): str(w) for it, w in found}


SIGNAL_VIEWS = ("rollouts", "scores", "audit", "eval")  # what reward_signals reads
