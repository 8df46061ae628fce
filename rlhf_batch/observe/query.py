"""SQL over a run (`rlhf-batch sql`) and a per-iteration summary (`rlhf-batch status`).

`connect(run_dir)` opens an in-memory DuckDB with fifteen views over every iteration, each with
an `iter` INTEGER column taken from the Hive layout (RUN_DIR/iter=0003/...); `sql` of one query
makes only the views it reads (`views_named`: each binds every file of its view, thousands on a
long run):

    rollouts    RUN_DIR/iter=*/rollouts/part-*.parquet and iter=*/topup=*/rollouts/part-*.parquet
    scores      RUN_DIR/iter=*/scores/part-*.parquet and iter=*/topup=*/scores/part-*.parquet
    advantages  RUN_DIR/iter=*/advantages/part-*.parquet
    metrics     RUN_DIR/iter=*/train/metrics.parquet
    rollout_stats  RUN_DIR/iter=*/train/rollout_stats.parquet: train's diagnostics per rollout and
                epoch, joinable to rollouts on rollout_id
    eval        RUN_DIR/iter=*/eval/part-*.parquet: held-out samples with reward and correct
    audit       RUN_DIR/iter=*/audit/part-*.parquet: `rlhf-batch audit`'s audit_<name> columns per
                rollout (and its round, topup), joinable to rollouts and scores on rollout_id
    eval_metrics  RUN_DIR/iter=*/eval/_manifest.json: (iter, data_source, metric, value)
    stages      RUN_DIR/iter=*/*/_manifest.json: one row per complete stage (see STAGES_VIEW)
    health      over metrics: one row per trained iteration, its flags (sql/health.sql, observe/health.py)
    reward_health  over scores, rollouts, audit, eval: one row per scored iteration, the flags of
                reward hacking (core/reward_health.py), computed when a query names it
    prompt_stats  over scores: per prompt_id, attempts, mean_score, pass_rate (score > 0.5) and
                last_iter over every iteration and round (sql/prompt_stats.sql, data/curriculum.py)
    source_stats  over rollouts and scores: per iteration and prompt source (a weighted mixture's
                `source`, null without one), prompts, rollouts, mean_score, mean_reward, pass_rate
    turns       over rollouts: one row per segment of a multi-turn trajectory (TURNS_VIEW); empty
                when no rollout has turns
    objectives  RUN_DIR/iter=*/train/_manifest.json: one row per trained iteration, the objective
                that trained it (train.objective: grpo, sft, dpo) and on how many rows (OBJECTIVES_VIEW);
                the rows themselves are the advantages view's (DPO's with `pair` and `chosen`)

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
from rlhf_batch.observe.health import REWARD_VIEW, create_view, register_reward_view, sequence_iterations
from rlhf_batch.sql import NAN_SAFE, quote, sql_text
from rlhf_batch.store import layout
from rlhf_batch.store.fs import register, run_path, snapshot
from rlhf_batch.store.manifests import manifest_of, manifests_read_once

VIEWS = {  # view -> (glob below RUN_DIR, schema name in rlhf_batch.store.schemas)
    "rollouts": (f"{layout.ITER_GLOB}/{layout.ROLLOUTS}/{layout.PART_GLOB}", "ROLLOUTS"),
    "scores": (f"{layout.ITER_GLOB}/{layout.SCORES}/{layout.PART_GLOB}", "SCORES"),
    "advantages": (f"{layout.ITER_GLOB}/{layout.ADVANTAGES}/{layout.PART_GLOB}", "ADVANTAGES"),
    "metrics": (f"{layout.ITER_GLOB}/{layout.TRAIN}/{layout.METRICS_FILE}", "METRICS"),
    "rollout_stats": (f"{layout.ITER_GLOB}/{layout.TRAIN}/{layout.ROLLOUT_STATS_FILE}", "ROLLOUT_STATS"),
    "eval": (f"{layout.ITER_GLOB}/{layout.EVAL}/{layout.PART_GLOB}", "EVAL"),
    "audit": (f"{layout.ITER_GLOB}/{layout.AUDIT}/{layout.PART_GLOB}", "AUDIT"),
}
TOPUP_VIEWS = ("rollouts", "scores")  # also the rows of the top-up rounds (iter=K/topup=RR/), column topup
# The stage manifests are the record of each stage's run: `numbers` holds every number at the
# manifest's top level and in its `counts` and `prompt_counts` objects (counts win on a clash),
# e.g. numbers['unscored'], numbers['kl_coef'], numbers['groups_total'], numbers['prompts_truncated'].
# startup_s, work_s, tokens and tokens_per_s come from its `timing` (timing.py; null before it).
STAGES_GLOB = f"{layout.ITER_GLOB}/*/{layout.MANIFEST}"
# Multi-turn rollouts (generate.environment, or imported messages): one row per segment of
# response_ids, in order: `segment` from 0, `role` (assistant, tool, user), `start` (offset in
# response_ids), `tokens`, `text` (the segment's tokens decoded, special tokens kept; null for
# rollouts written before `turn_texts` was stored), `sampled` (the assistant's, trained),
# `turns` (the trajectory's assistant turns), and on the trajectory's last segment its
# `env_error` (null elsewhere, and for imported rows) and `env_seconds`. A column some
# rollouts lack (imported rows have no environment columns) is null there.
TURNS_VIEW = """
SELECT iter, topup, rollout_id, prompt_id, i - 1 AS segment, turn_roles[i] AS role,
       turn_starts[i] AS start,
       coalesce(turn_starts[i + 1], len(response_ids)) - turn_starts[i] AS tokens,
       {text} AS text,
       turn_roles[i] = 'assistant' AS sampled, {turns} AS turns,
       CASE WHEN i = len(turn_roles) THEN {env_error} END AS env_error,
       CASE WHEN i = len(turn_roles) THEN {env_seconds} END AS env_seconds
FROM (SELECT *, unnest(range(1, len(turn_roles) + 1)) AS i FROM rollouts WHERE turn_roles IS NOT NULL)
"""
TURNS_EMPTY = """
SELECT NULL::INTEGER AS iter, NULL::INTEGER AS topup, NULL::VARCHAR AS rollout_id,
       NULL::VARCHAR AS prompt_id, NULL::BIGINT AS segment, NULL::VARCHAR AS role,
       NULL::INTEGER AS start, NULL::BIGINT AS tokens, NULL::VARCHAR AS text, NULL::BOOLEAN AS sampled,
       NULL::INTEGER AS turns, NULL::VARCHAR AS env_error, NULL::DOUBLE AS env_seconds
WHERE false
"""


def turns_view(columns: set[str]) -> str:
    """The `turns` view over rollouts with `columns`: TURNS_VIEW, each optional column read where
    the rollouts have it (null, or for `turns` the assistant segments counted, where not)."""
    if "turn_roles" not in columns:
        return TURNS_EMPTY
    assistants = "len(list_filter(turn_roles, lambda r: r = 'assistant'))::INTEGER"
    values = {
        "text": "turn_texts[i]" if "turn_texts" in columns else "NULL::VARCHAR",
        "turns": f"coalesce(turns, {assistants})" if "turns" in columns else assistants,
        "env_error": "env_error" if "env_error" in columns else "NULL::VARCHAR",
        "env_seconds": "env_seconds" if "env_seconds" in columns else "NULL::DOUBLE",
    }
    return TURNS_VIEW.format(**values)


STAGES_TOPUP_GLOB = (
    f"{layout.ITER_GLOB}/{layout.TOPUP_GLOB}/*/{layout.MANIFEST}"  # a top-up round's rollouts and scores
)
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
# What trained each iteration (train.objective): `objective` (grpo for trains written before it
# was recorded), `rows` (the advantages rows trained on: the selected ones of an SFT iteration,
# two per pair of a DPO one), `pairs` (DPO; null otherwise), `steps`.
OBJECTIVES_GLOB = f"{layout.ITER_GLOB}/{layout.TRAIN}/{layout.MANIFEST}"
OBJECTIVES_VIEW = """
SELECT iter, coalesce(json->>'objective', 'grpo') AS objective, (json->'counts'->>'sequences')::BIGINT AS rows,
       (json->'counts'->>'pairs')::BIGINT AS pairs, (json->'counts'->>'steps')::BIGINT AS steps
FROM {source}
"""
# The held-out metrics of every eval manifest, long form: one row per (iter, data_source, metric),
# metric `mean@n`, `best@n`, `pass@k` or `prompts`.
EVAL_METRICS_GLOB = f"{layout.ITER_GLOB}/{layout.EVAL}/{layout.MANIFEST}"
EVAL_METRICS_VIEW = """
SELECT iter, data_source, metric, (m->>metric)::DOUBLE AS value
FROM (SELECT iter, data_source, m, unnest(json_keys(m)) AS metric
      FROM (SELECT iter, data_source, json->'metrics'->data_source AS m
            FROM (SELECT iter, json, unnest(json_keys(json->'metrics')) AS data_source FROM {source})
            UNION ALL
            SELECT iter, 'overall' AS data_source, json->'overall' AS m
            FROM {source} WHERE (json->'overall') IS NOT NULL AND json_keys(json->'overall') <> []))
"""
FORMATS = ("table", "csv", "json", "parquet")
SUFFIXES = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
READ_ONLY = (
    "only read queries (SELECT, FROM, WITH, VALUES, SHOW, DESCRIBE, SUMMARIZE) can run: the run is read-only"
)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def existing_run(run_dir: str | Path, where: str = "") -> Path:
    """The run directory `run_dir` (resolved; a UPath resolves to itself), which must exist and
    be readable by DuckDB's globs; `where`: how it was named, for the error. On an object store
    it is read through one listing of the run (`snapshot`): the read commands' looks cost no
    request each."""
    root = snapshot(run_path(run_dir).expanduser().resolve())
    if not root.is_dir():
        raise UserError(f"{root}: run directory not found{where}")
    if any(c in str(root) for c in "*?[]{}"):
        raise UserError(f"{root}: the run directory's path must not contain glob characters (*?[]{{}})")
    return root


def connect(run_dir: str | Path, names: set[str] | None = None) -> Any:
    """A DuckDB connection with the run's views (`names`: those and the views they read alone;
    None: every view), sandboxed to reading below RUN_DIR. A committed file DuckDB cannot read
    (corrupt, no permission) is one line naming it."""
    import duckdb

    root = existing_run(run_dir)
    con = duckdb.connect(":memory:")
    try:
        with manifests_read_once():  # train's: by metrics, rollout_stats and health alike
            _views(con, root, set(ALL_VIEWS) if names is None else needed(names))
    except duckdb.Error as e:
        con.close()
        raise UserError(f"{root}: cannot read the run ({first_line(e)})") from None
    return con


def first_line(e: BaseException) -> str:
    """The first line of an error (DuckDB's later lines quote the SQL)."""
    return next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)


# the views each view reads (reward_health: a table made when a query names it, health.py)
READS = {
    "health": {"metrics"},
    "prompt_stats": {"scores"},
    "source_stats": {"rollouts", "scores"},
    "turns": {"rollouts"},
    REWARD_VIEW: {"rollouts", "scores", "audit", "eval", "stages"},
}
ALL_VIEWS = (
    *VIEWS,
    "stages",
    "eval_metrics",
    "objectives",
    "health",
    "prompt_stats",
    "source_stats",
    "turns",
)


def needed(names: set[str]) -> set[str]:
    """The views `names` are, with those they read."""
    return set(names) | {v for n in names for v in READS.get(n, set())}


def views_named(query: str) -> set[str] | None:
    """The run's views (and reward_health) one SELECT reads, by DuckDB's own parse of it; None
    where that cannot be told for sure (no SELECT, a table function, SHOW, another schema, a
    name that is no view: a CTE's, a file's): then every view is made, as for any query, so
    each error and suggestion DuckDB gives is the same."""
    import duckdb

    con = duckdb.connect(":memory:")
    try:
        row = con.execute("SELECT json_serialize_sql(?)", [query]).fetchone()
    except duckdb.Error:
        return None
    finally:
        con.close()
    tree = json.loads(row[0]) if row else {"error": True}
    if tree.get("error"):
        return None
    found: set[str] = set()
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, dict):
            kind = node.get("type")
            if kind in ("TABLE_FUNCTION", "SHOW_REF"):
                return None
            if kind == "BASE_TABLE":
                name = str(node.get("table_name", "")).lower()
                if node.get("schema_name", "") not in ("", "main") or node.get("catalog_name", ""):
                    return None
                if name not in (*ALL_VIEWS, REWARD_VIEW):
                    return None
                found.add(name)
            stack += node.values()
    return found


def _views(con: Any, root: Path, names: set[str]) -> None:
    from rlhf_batch.store import schemas

    register(con, root)
    for setting in ("enable_progress_bar", "autoinstall_known_extensions", "autoload_known_extensions"):
        con.execute(f"SET {setting} = false")
    # each view over thousands of files reads their footers again where a query binds it: once
    con.execute("SET parquet_metadata_cache = true")
    con.execute(NAN_SAFE)
    for name, (pattern, schema_name) in VIEWS.items():
        if name not in names:
            continue
        rounds = name in TOPUP_VIEWS
        selects = []
        if files := listed(root, pattern):
            selects.append(_read_parts(files, ["iter"], ", 0::INTEGER AS topup" if rounds else ""))
        if rounds and (files := listed(root, pattern.replace("/", f"/{layout.TOPUP_GLOB}/", 1))):
            selects.append(_read_parts(files, ["iter", "topup"]))
        if selects:
            con.execute(f"CREATE VIEW {name} AS " + " UNION ALL BY NAME ".join(selects))
        else:  # no files yet: an empty table with the schema, so queries over it still bind
            empty_table(con, name, getattr(schemas, schema_name), ["iter", "topup"] if rounds else ["iter"])
    for name, pattern, view, topup_pattern in [
        ("stages", STAGES_GLOB, STAGES_VIEW, STAGES_TOPUP_GLOB),
        ("eval_metrics", EVAL_METRICS_GLOB, EVAL_METRICS_VIEW, ""),
        ("objectives", OBJECTIVES_GLOB, OBJECTIVES_VIEW, ""),
    ]:
        if name in names:
            _manifest_view(con, root, name, pattern, view, topup_pattern)
    if "health" in names:
        trained = {int(p.parent.name.split("=")[1]) for p in root.glob(f"{layout.ITER_GLOB}/{layout.TRAIN}")}
        create_view(con, sequence_iterations(root, sorted(trained)))  # health, over metrics
    if "prompt_stats" in names:
        _prompt_stats_view(con)
    if names & {"source_stats", "turns"}:
        columns = {r[0] for r in con.execute("DESCRIBE rollouts").fetchall()}  # bound once, over every file
        if "source_stats" in names:
            _source_stats_view(con, columns)
        if "turns" in names:
            con.execute("CREATE VIEW turns AS " + turns_view(columns))
    con.execute("SET temp_directory = ''")  # else DuckDB allows its temp dir (./.tmp) too
    con.execute(f"SET allowed_directories = [{quote(str(root) + os.sep)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


DUCKDB_TYPES = {  # the Arrow types of store/schemas.py, as DuckDB reads them from Parquet
    "string": "VARCHAR",
    "bool": "BOOLEAN",
    "int32": "INTEGER",
    "int64": "BIGINT",
    "float": "FLOAT",
    "double": "DOUBLE",
}


def duckdb_type(t: Any) -> str:
    """The DuckDB type of the Arrow type `t` (a list: its items' type with []); written out in
    SQL, not handed to DuckDB as an Arrow table: that would import pandas (~0.5 s a command)."""
    import pyarrow as pa

    if pa.types.is_list(t):
        return duckdb_type(t.value_type) + "[]"
    if str(t) not in DUCKDB_TYPES:
        raise TypeError(f"no DuckDB type for the Arrow type {t}")
    return DUCKDB_TYPES[str(t)]


def empty_table(con: Any, name: str, schema: Any, keys: list[str]) -> None:
    """Table `name`: no row, the columns of the Arrow `schema`, then INTEGER `keys` (iter, topup)."""
    from rlhf_batch.sql import quote_ident

    columns = [f"{quote_ident(f.name)} {duckdb_type(f.type)}" for f in schema]
    con.execute(f"CREATE TABLE {name} ({', '.join([*columns, *(f'{k} INTEGER' for k in keys)])})")


def _prompt_stats_view(con: Any) -> None:
    """prompt_stats: per prompt over every iteration's scores (sql/prompt_stats.sql), a pass being
    score > the default generate.pass_threshold (what generate.prompt_filter decides on)."""
    from rlhf_batch.config import GenerateConfig
    from rlhf_batch.data.curriculum import stats_query

    con.execute("CREATE VIEW prompt_stats AS " + stats_query(float(GenerateConfig().pass_threshold)))


def _source_stats_view(con: Any, columns: set[str]) -> None:
    """source_stats: per iteration and prompt source (sql/source_stats.sql; `columns`: the
    rollouts view's), a pass as in prompt_stats."""
    from rlhf_batch.config import GenerateConfig

    threshold = repr(float(GenerateConfig().pass_threshold))
    source = "r.source" if "source" in columns else "NULL::VARCHAR"  # a weighted mixture's sources
    text = sql_text("source_stats").replace("{source}", source).replace("{threshold}", threshold)
    con.execute("CREATE VIEW source_stats AS " + text)


def _read_parts(files: list[str], keys: list[str], extra: str = "") -> str:
    """SELECT over Parquet files with the Hive keys `keys` (iter=K, topup=RR) as INTEGER columns."""
    types = ", ".join(f"'{k}': INTEGER" for k in keys)
    return (
        f"SELECT *{extra} FROM read_parquet([{', '.join(map(quote, files))}], "
        f"hive_partitioning = true, hive_types = {{{types}}}, union_by_name = true)"
    )


def listed(root: Path, pattern: str) -> list[str]:
    """The files of `pattern` (below `root`) that a complete folder's manifest lists: no part of a
    partial folder, no orphan part, no metrics of a train that did not finish (a folder a forced
    run's output is being swapped into: its staged copy, `manifests.current`)."""
    from fnmatch import fnmatchcase

    from rlhf_batch.store.layout import METRICS_FILE, ROLLOUT_STATS_FILE
    from rlhf_batch.store.manifests import current

    out, glob = [], Path(pattern).name
    for folder in sorted({f.parent for f in root.glob(pattern)}):
        src = current(folder)
        if (m := manifest_of(src)) is None:
            continue
        names = {p["file"] for p in m["parts"]} | {METRICS_FILE, ROLLOUT_STATS_FILE}
        found = [src / n for n in sorted(names) if fnmatchcase(n, glob)]  # no listing of each folder
        out += [str(f) for f in found if f.exists()]
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
    if query is not None:
        try:
            query.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 on the command line
            raise UserError("sql: the query is not UTF-8 text") from None
    con = connect(run_dir, None if query is None else views_named(query))  # the views it reads alone
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
        if REWARD_VIEW in query.lower() and REWARD_VIEW not in _names(con):
            register_reward_view(con)  # computed when a query names it (observe/health.py)
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


def _names(con: Any) -> set[str]:
    return {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}


def _write_file(reader: Any, kind: str, out: Path) -> int:
    """Write the rows to `out` (temporary name, then rename); return the row count."""
    import pyarrow.parquet as pq

    from rlhf_batch.store.atomic import write_file_atomic

    def write(tmp: Path) -> int:
        if kind != "parquet":
            with open(tmp, "w", newline="") as f:
                return _write_text(reader, kind, f)
        rows = 0
        with pq.ParquetWriter(tmp, reader.schema, compression="zstd") as w:
            for batch in reader:
                w.write_batch(batch)
                rows += batch.num_rows
        return rows

    return write_file_atomic(out, write)


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
            f"views: {', '.join([*VIEWS, 'stages', 'eval_metrics', 'health', REWARD_VIEW, 'prompt_stats', 'source_stats', 'turns', 'objectives'])} (column iter). End a query with ';'. .quit to leave.",
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


def iteration_reward_warning(run_dir: str | Path, it: int) -> str | None:
    """The reward_health warning of iteration `it` (None: no flag), as `reward_warnings` over the
    whole run gives it, from the files of `it` and of its baselines alone: the iterations from
    it - window back to the latest one that has the score and each signal `it` has (one
    iteration where every stage runs each iteration), so its cost does not grow with the run."""
    from rlhf_batch.core.reward_health import flags
    from rlhf_batch.observe.health import REWARD_THRESHOLDS
    from rlhf_batch.store import fs

    root = fs.run_path(run_dir)
    window = int(REWARD_THRESHOLDS["window"])
    # one connection for `it` and it - window: all there is to read where every stage runs each iteration
    first = [it, it - window] if it >= window else [it]
    series, parts = iteration_reward_signals(root, first)
    if it not in series["score"]:
        return None
    wanted = {name for name, sig in series.items() if it in sig} - {"score"}
    if it >= window and it - window in series["score"]:
        wanted -= {name for name, sig in series.items() if it - window in sig}
    loaded = dict(series)
    j = it - window - 1
    while j >= 0 and wanted:  # further back, to each signal's baseline
        more, _ = iteration_reward_signals(root, [j])
        if j in more["score"]:
            wanted -= {name for name, sig in more.items() if j in sig}
        for name, sig in more.items():
            loaded[name] = {**loaded.get(name, {}), **sig}
        j -= 1
    loaded.setdefault("length", {})
    found = flags(loaded, parts, REWARD_THRESHOLDS).get(it, [])
    return "; ".join(w for _, w in found) or None


def iteration_reward_signals(
    root: Path, its: list[int]
) -> tuple[dict[str, dict[int, Any]], dict[int, dict[str, float | None]]]:
    """`reward_signals` over the complete files of iterations `its` only (their top-up rounds
    included, as the run's views hold them)."""
    import duckdb

    from rlhf_batch.observe.health import SIGNAL_VIEWS, reward_signals
    from rlhf_batch.store import fs, manifests, schemas

    con = duckdb.connect(":memory:")
    try:
        fs.register(con, root)  # a run on an object store
        for name in SIGNAL_VIEWS:
            pattern, schema_name = VIEWS[name]
            selects = []
            for k in its:
                own = pattern.replace(layout.ITER_GLOB, layout.iter_name(k), 1)
                if files := listed(root, own):
                    extra = ", 0::INTEGER AS topup" if name in TOPUP_VIEWS else ""
                    selects.append(_read_parts(files, ["iter"], extra))
                if name in TOPUP_VIEWS and (
                    files := listed(root, own.replace("/", f"/{layout.TOPUP_GLOB}/", 1))
                ):
                    selects.append(_read_parts(files, ["iter", "topup"]))
            if selects:
                con.execute(f"CREATE VIEW {name} AS " + " UNION ALL BY NAME ".join(selects))
            else:
                empty_table(con, name, getattr(schemas, schema_name), ["iter"])
        texts = []
        for k in its:
            m = manifests.manifest(layout.folder(root, k, layout.SCORES))
            if m is not None:
                texts.append((k, json.dumps(m)))
        return reward_signals(con, texts)
    finally:
        con.close()
