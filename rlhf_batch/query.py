"""SQL over a run (`rlhf-batch sql`) and a per-iteration summary (`rlhf-batch status`).

`connect(run_dir)` opens an in-memory DuckDB with seven views over every iteration, each with
an `iter` INTEGER column taken from the Hive layout (RUN_DIR/iter=0003/...):

    rollouts    RUN_DIR/iter=*/rollouts/part-*.parquet and iter=*/topup=*/rollouts/part-*.parquet
    scores      RUN_DIR/iter=*/scores/part-*.parquet and iter=*/topup=*/scores/part-*.parquet
    advantages  RUN_DIR/iter=*/advantages/part-*.parquet
    metrics     RUN_DIR/iter=*/train/metrics.parquet
    eval        RUN_DIR/iter=*/eval/part-*.parquet: held-out samples with reward and correct
    eval_metrics  RUN_DIR/iter=*/eval/_manifest.json: (iter, data_source, metric, value)
    stages      RUN_DIR/iter=*/*/_manifest.json: one row per complete stage (see STAGES_VIEW)

rollouts, scores and stages also have a `topup` INTEGER column: 0 for an iteration's own rows,
r for those of its dynamic-sampling top-up round r (RUN_DIR/iter=0003/topup=01/...; topup.py).
A view whose files do not exist yet is an empty table with the stage's schema. The connection
is read-only with respect to the run, in two layers: DuckDB may only touch files below RUN_DIR
(`allowed_directories` + `enable_external_access = false`, then `lock_configuration = true`, so
no query can undo it: reading /etc/passwd, ATTACH elsewhere, INSTALL/LOAD fail), and only
read statements are run (a DuckDB `allowed_directories` entry also allows writing there, so
COPY, EXPORT, ATTACH, CREATE, ... are refused before they reach DuckDB, and so is EXPLAIN, whose
ANALYZE form executes its statement). `--out` files are written by Python (pyarrow), not by DuckDB.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_batch.errors import ConfigError, UserError
from rlhf_batch.sql import NAN_SAFE, quote, sql_text

VIEWS = {  # view -> (glob below RUN_DIR, schema name in rlhf_batch.schemas)
    "rollouts": ("iter=*/rollouts/part-*.parquet", "ROLLOUTS"),
    "scores": ("iter=*/scores/part-*.parquet", "SCORES"),
    "advantages": ("iter=*/advantages/part-*.parquet", "ADVANTAGES"),
    "metrics": ("iter=*/train/metrics.parquet", "METRICS"),
    "eval": ("iter=*/eval/part-*.parquet", "EVAL"),
}
TOPUP_VIEWS = ("rollouts", "scores")  # also the rows of the top-up rounds (iter=K/topup=RR/), column topup
# The stage manifests are the record of each stage's run: `numbers` holds every number at the
# manifest's top level and in its `counts` and `prompt_counts` objects (counts win on a clash),
# e.g. numbers['unscored'], numbers['kl_coef'], numbers['groups_total'], numbers['prompts_truncated'].
# startup_s, work_s, tokens and tokens_per_s come from its `timing` (timing.py; null before it).
STAGES_GLOB = "iter=*/*/_manifest.json"
STAGES_TOPUP_GLOB = "iter=*/topup=*/*/_manifest.json"  # a top-up round's rollouts and scores
STAGES_VIEW = """
SELECT iter, regexp_extract(filename, '([^/]+)/_manifest\\.json$', 1) AS stage, topup,
       (json->>'rows')::BIGINT AS rows,
       map_from_entries([{'k': k, 'v': (flat->>k)::DOUBLE} FOR k IN json_keys(flat)
                         IF json_type(flat->k) IN ('UBIGINT', 'BIGINT', 'DOUBLE')]) AS numbers,
       try_strptime(json->>'created', '%Y-%m-%dT%H:%M:%S%z') AS finished,
       (json->'timing'->>'startup_s')::DOUBLE AS startup_s, (json->'timing'->>'work_s')::DOUBLE AS work_s,
       (json->'timing'->>'tokens')::BIGINT AS tokens, (json->'timing'->>'tokens_per_s')::DOUBLE AS tokens_per_s,
       json AS manifest
FROM (SELECT *, json_merge_patch(json, coalesce(json->'prompt_counts', '{}'), coalesce(json->'counts', '{}'))
      AS flat FROM {source})
"""
# The held-out metrics of every eval manifest, long form: one row per (iter, data_source, metric),
# metric `mean@n`, `best@n`, `pass@k` or `prompts`.
EVAL_METRICS_GLOB = "iter=*/eval/_manifest.json"
EVAL_METRICS_VIEW = """
SELECT iter, data_source, metric, (m->>metric)::DOUBLE AS value
FROM (SELECT iter, data_source, m, unnest(json_keys(m)) AS metric
      FROM (SELECT iter, data_source, json->'metrics'->data_source AS m
            FROM (SELECT iter, json, unnest(json_keys(json->'metrics')) AS data_source FROM {source})))
"""
FORMATS = ("table", "csv", "json", "parquet")
SUFFIXES = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
READ_ONLY = (
    "only read queries (SELECT, FROM, WITH, VALUES, SHOW, DESCRIBE, SUMMARIZE) can run: the run is read-only"
)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def run_root(run_dir: str | Path) -> Path:
    root = Path(run_dir).expanduser().resolve()
    if not root.is_dir():
        raise UserError(f"{root}: run directory not found")
    if any(c in str(root) for c in "*?[]{}"):
        raise UserError(f"{root}: the run directory's path must not contain glob characters (*?[]{{}})")
    return root


def connect(run_dir: str | Path) -> Any:
    """A DuckDB connection with the run's views, sandboxed to reading below RUN_DIR."""
    import duckdb
    import pyarrow as pa

    from rlhf_batch import schemas

    root = run_root(run_dir)
    con = duckdb.connect(":memory:")
    for setting in ("enable_progress_bar", "autoinstall_known_extensions", "autoload_known_extensions"):
        con.execute(f"SET {setting} = false")
    con.execute(NAN_SAFE)
    for name, (pattern, schema_name) in VIEWS.items():
        rounds = name in TOPUP_VIEWS
        selects = []
        if files := listed(root, pattern):
            selects.append(_read_parts(files, ["iter"], ", 0::INTEGER AS topup" if rounds else ""))
        if rounds and (files := listed(root, pattern.replace("/", "/topup=*/", 1))):
            selects.append(_read_parts(files, ["iter", "topup"]))
        if selects:
            con.execute(f"CREATE VIEW {name} AS " + " UNION ALL BY NAME ".join(selects))
        else:  # no files yet: an empty table with the schema, so queries over it still bind
            empty: pa.Table = getattr(schemas, schema_name).empty_table()
            con.register("_empty", empty)
            extra = ", NULL::INTEGER AS topup" if rounds else ""
            con.execute(f"CREATE TABLE {name} AS SELECT *, NULL::INTEGER AS iter{extra} FROM _empty")
            con.unregister("_empty")
    _manifest_view(con, root, "stages", STAGES_GLOB, STAGES_VIEW, STAGES_TOPUP_GLOB)
    _manifest_view(con, root, "eval_metrics", EVAL_METRICS_GLOB, EVAL_METRICS_VIEW)
    con.execute("SET temp_directory = ''")  # else DuckDB allows its temp dir (./.tmp) too
    con.execute(f"SET allowed_directories = [{quote(str(root) + os.sep)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _read_parts(files: list[str], keys: list[str], extra: str = "") -> str:
    """SELECT over Parquet files with the Hive keys `keys` (iter=K, topup=RR) as INTEGER columns."""
    types = ", ".join(f"'{k}': INTEGER" for k in keys)
    return (
        f"SELECT *{extra} FROM read_parquet([{', '.join(map(quote, files))}], "
        f"hive_partitioning = true, hive_types = {{{types}}}, union_by_name = true)"
    )


def listed(root: Path, pattern: str) -> list[str]:
    """The files of `pattern` (below `root`) that a complete folder's manifest lists: no part of a
    partial folder, no orphan part, no metrics of a train that did not finish."""
    from rlhf_batch.layout import METRICS_FILE
    from rlhf_batch.manifests import manifest

    out, parts = [], {}
    for f in sorted(root.glob(pattern)):
        if f.parent not in parts:
            m = manifest(f.parent)
            parts[f.parent] = {p["file"] for p in m["parts"]} | {METRICS_FILE} if m is not None else set()
        if f.name in parts[f.parent]:
            out.append(str(f))
    return out


def _manifest_view(con: Any, root: Path, name: str, pattern: str, view: str, topup_pattern: str = "") -> None:
    """View `name`: `view` over the manifests matching `pattern` (columns iter, filename, json), and
    with `topup_pattern` those of the top-up rounds too (column topup, 0 for round 0)."""
    topup = ", 0::INTEGER AS topup" if topup_pattern else ""
    sources = [
        f"SELECT *{extra} FROM read_json_objects({quote(str(root / glob))}, filename = true, "
        f"hive_partitioning = true, hive_types = {{{types}}})"
        for glob, extra, types in [
            (pattern, topup, "'iter': INTEGER"),
            (topup_pattern, "", "'iter': INTEGER, 'topup': INTEGER"),
        ]
        if glob and any(root.glob(glob))
    ]
    empty = "SELECT NULL::INTEGER AS iter, NULL::VARCHAR AS filename, NULL::JSON AS json"
    empty += (", NULL::INTEGER AS topup" if topup_pattern else "") + " WHERE false"
    source = "(" + (" UNION ALL BY NAME ".join(sources) or empty) + ")"
    con.execute(f"CREATE VIEW {name} AS " + view.replace("{source}", source))


def run_sql(
    run_dir: str | Path,
    query: str | None,
    fmt: str = "table",
    out: str | Path | None = None,
    timeout: float = 600.0,
) -> None:
    """Run one read query over the run and print it (`fmt`) or write it to `out`; without a
    query, read queries from stdin (each ended by ';') until EOF or `.quit`. A query still
    running after `timeout` seconds is stopped (0: no limit)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not timeout >= 0:
        raise ConfigError(f"--timeout: must be >= 0 seconds, got {timeout}")
    con = connect(run_dir)
    try:
        if query is None:
            _repl(con)
        else:
            with _time_limit(con, timeout):
                _run_one(con, query, fmt, Path(out) if out else None)
    finally:
        con.close()


@contextlib.contextmanager
def _time_limit(con: Any, seconds: float) -> Iterator[None]:
    """Interrupt the connection's query after `seconds`; the interrupt is one line naming --timeout."""
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        con.interrupt()

    timer = threading.Timer(seconds, stop) if seconds > 0 else None
    if timer is not None:
        timer.start()
    try:
        yield
    except UserError:
        if fired.is_set():
            raise UserError(f"sql: stopped after {seconds:g} s (--timeout; 0 for no limit)") from None
        raise
    finally:
        if timer is not None:
            timer.cancel()


def _run_one(con: Any, query: str, fmt: str, out: Path | None) -> None:
    import duckdb

    try:
        statements = con.extract_statements(query)
        if len(statements) != 1:
            raise UserError(f"sql: give exactly one statement, got {len(statements)}")
        if statements[0].type != duckdb.StatementType.SELECT:
            raise UserError(f"sql: {statements[0].type.name} refused; {READ_ONLY}")
        rel = con.sql(query)
        if out is not None:
            kind = SUFFIXES.get(out.suffix.lower()) if fmt == "table" else fmt
            if kind is None:
                raise UserError(f"--out {out}: give --format csv|json|parquet or a .csv/.json/.parquet name")
            rows = _write_file(rel.to_arrow_reader(), kind, out)
            print(f"{out}: {rows} rows", file=sys.stderr)
        elif fmt == "table":
            width = shutil.get_terminal_size((200, 24)).columns if sys.stdout.isatty() else 200
            rel.show(max_rows=100, max_width=width)
        elif fmt == "parquet":
            raise UserError("--format parquet needs --out FILE")
        else:
            _write_text(rel.to_arrow_reader(), fmt, sys.stdout)
    except duckdb.Error as e:
        raise UserError(f"sql: {one_line(e)}") from None


def _write_file(reader: Any, kind: str, out: Path) -> int:
    """Write the rows to `out` (temporary name, then rename); return the row count."""
    import pyarrow.parquet as pq

    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if kind == "parquet":
            rows = 0
            with pq.ParquetWriter(tmp, reader.schema, compression="zstd") as w:
                for batch in reader:
                    w.write_batch(batch)
                    rows += batch.num_rows
        else:
            with open(tmp, "w", newline="") as f:
                rows = _write_text(reader, kind, f)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return rows


def _write_text(reader: Any, kind: str, f: Any) -> int:
    """CSV (nested values as JSON) or JSON Lines (non-finite floats as null), batch by batch."""
    rows = 0
    writer = csv.writer(f) if kind == "csv" else None
    if writer is not None:
        writer.writerow(reader.schema.names)
    for batch in reader:
        for row in batch.to_pylist():
            if writer is not None:
                writer.writerow(
                    [
                        json.dumps(_clean(v), default=str) if isinstance(v, list | dict) else v
                        for v in row.values()
                    ]
                )
            else:
                f.write(json.dumps(_clean(row), default=str) + "\n")
        rows += batch.num_rows
    return rows


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return v


def _repl(con: Any) -> None:
    interactive = sys.stdin.isatty()
    if interactive:
        print(
            f"views: {', '.join([*VIEWS, 'stages', 'eval_metrics'])} (column iter). End a query with ';'. .quit to leave.",
            file=sys.stderr,
        )
    buf: list[str] = []
    try:
        while True:
            if interactive:
                print("sql> " if not buf else "...> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or (not buf and line.strip() in (".quit", ".exit", "\\q")):
                break
            if line.strip():
                buf.append(line)
            if buf and line.rstrip().endswith(";"):
                _repl_one(con, "".join(buf))
                buf = []
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return
    if buf:
        _repl_one(con, "".join(buf))


def _repl_one(con: Any, query: str) -> None:
    try:
        _run_one(con, query, "table", None)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)


STATUS_STAGES = ("rollouts", "scores", "advantages", "train", "eval")  # eval: only where it ran


def print_status(run_dir: str | Path) -> None:
    """Per iteration and stage: complete / partial / missing, rows, start-up and work seconds and
    tokens/s of the run that completed it (its manifest's `timing`), and headline numbers."""
    root = run_root(run_dir)
    iters = sorted(int(p.name[5:]) for p in root.glob("iter=*") if p.is_dir() and p.name[5:].isdigit())
    if not iters:
        print(f"{root}: no iterations yet")
        return
    con = connect(root)
    try:
        rows = [
            (str(it), label, *_stage_status(con, root, it, stage, r))
            for it in iters
            for label, stage, r in _status_stages(root, it)
        ]
    finally:
        con.close()
    table = [("iter", "stage", "state", "rows", "startup_s", "work_s", "tok/s", "details"), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(7)]
    print(f"run: {root}")
    for r in table:
        cells = [
            c.ljust(w) if i in (1, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        print("  ".join([*cells, r[7]]).rstrip())


def _status_stages(root: Path, it: int) -> list[tuple[str, str, int]]:
    """(label, stage folder, top-up round) of the rows `status` shows for iteration `it`: each
    stage, eval only where it ran, and after scores each top-up round's rollouts and scores."""
    idir = root / f"iter={it:04d}"
    rounds = sorted(int(p.name[6:]) for p in idir.glob("topup=*") if p.is_dir() and p.name[6:].isdigit())
    out = []
    for stage in STATUS_STAGES:
        if stage != "eval" or (idir / stage).exists():
            out.append((stage, stage, 0))
        if stage == "scores":
            out += [(f"topup={r:02d}/{s}", s, r) for r in rounds for s in ("rollouts", "scores")]
    return out


def _stage_status(con: Any, root: Path, it: int, stage: str, topup: int = 0) -> tuple[str, ...]:
    """(state, rows, startup, work, tok/s, details) of one stage of one iteration (of its top-up
    round `topup`)."""
    import duckdb
    import pyarrow.parquet as pq

    from rlhf_batch import layout, manifests

    sdir = layout.folder(root, it, stage, topup)
    m = manifests.manifest(sdir)
    if stage == "train":
        files = [f for f in [sdir / "metrics.parquet"] if f.exists()]
        started = sdir.exists() or layout.policy_dir(root, it).exists()
    else:
        files = [sdir / p["file"] for p in m["parts"]] if m else layout.list_parts(sdir)
        started = sdir.exists()
    state = "complete" if m else "partial" if started else "missing"
    details = []
    if files:
        try:
            cur = con.execute(sql_text(f"status_{stage}"), {"files": [str(f) for f in files]})
            values = dict(zip([d[0] for d in cur.description], cur.fetchall()[0], strict=True))
            details = [f"{k} {_fmt(v)}" for k, v in values.items()]
        except duckdb.Error as e:  # a damaged file must not hide the other stages
            details = [f"unreadable ({one_line(e)})"]
    if stage == "advantages" and m:
        c = m.get("counts", {})
        details.append(f"kept {c.get('groups_out', '?')}/{c.get('groups_total', '?')} groups")
        if m.get("topup_rounds"):
            details.append(f"with top-up rounds {', '.join(map(str, m['topup_rounds']))}")
    if stage == "rollouts" and topup and m and (b := m.get("prompt_batch") or {}).get("batch") is not None:
        details.append(
            f"prompt batch {b['batch']} (epoch {b['epoch']}, positions {b['positions'][0]}-{b['positions'][1]})"
        )
    if stage == "eval" and m:
        details += eval_details(m)
    if stage == "train" and (layout.policy_dir(root, it) / "config.json").exists():
        details.append("policy saved")
    elif stage == "train" and (layout.iter_dir(root, it) / layout.POLICY_REMOVED).exists():
        details.append("policy removed (keep_policies)")
    rows = m["rows"] if m and stage != "train" else sum(pq.read_metadata(f).num_rows for f in files)
    return state, str(rows) if files or m else "-", *timing_cells(m), ", ".join(details)


def timing_cells(m: dict[str, Any] | None) -> tuple[str, str, str]:
    """Start-up and work seconds and tokens/s of a manifest's `timing`; "-" where it has none."""
    t = (m or {}).get("timing") or {}

    def cell(key: str, spec: str) -> str:
        return "-" if t.get(key) is None else format(t[key], spec)

    return cell("startup_s", ".1f"), cell("work_s", ".1f"), cell("tokens_per_s", ".0f")


def eval_details(m: dict[str, Any]) -> list[str]:
    """`source: mean@n x, pass@k y, ...` per data source of an eval manifest."""
    order = ("mean", "pass", "best", "maj")

    def key(name: str) -> tuple[int, int]:
        kind, _, k = name.partition("@")
        return order.index(kind) if kind in order else len(order), int(k) if k.isdigit() else 0

    return [
        f"{source}: " + " ".join(f"{k} {_fmt(values[k])}" for k in sorted(values, key=key) if k != "prompts")
        for source, values in m.get("metrics", {}).items()
    ]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
