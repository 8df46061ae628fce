"""The DuckDB queries (the .sql files of this package) and the helpers to run them."""

from __future__ import annotations

# DuckDB folds isnan(x) to false from Parquet min/max statistics, which leave NaN out, so a NaN
# would pass as a number; without statistics propagation isnan() looks at the values.
NAN_SAFE = "SET disabled_optimizers = 'statistics_propagation'"


def quote(text: str) -> str:
    """A SQL string literal, for paths the code built (never for user SQL)."""
    return "'" + text.replace("'", "''") + "'"


def quote_ident(name: str) -> str:
    """A SQL identifier (a column name a file holds), double-quoted."""
    return '"' + name.replace('"', '""') + '"'


def sql_text(name: str) -> str:
    """The text of rlhf_batch/sql/<name>.sql (package data)."""
    from importlib.resources import files

    return files("rlhf_batch.sql").joinpath(f"{name}.sql").read_text()


def reads_problem(predicate: str, tables: tuple[str, ...] = ()) -> str:
    """Why the SQL predicate `predicate` may not run ("" when it may): it reads a file, a table
    function (read_csv, read_text, ...) or a table other than `tables`. DuckDB's own parser
    decides (json_serialize_sql), so a subquery anywhere in it is seen; the one guard of every
    predicate a config holds (generate.prompt_filter, advantage.replay.where)."""
    import json

    import duckdb

    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_external_access = false")
        query = f"SELECT 1 FROM {WRAPPER} WHERE ({predicate})"
        row = con.execute("SELECT json_serialize_sql(?)", [query]).fetchone()
        tree = json.loads(row[0]) if row else {}
    except duckdb.Error as e:
        return next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    finally:
        con.close()
    if tree.get("error"):  # not SQL: the caller's own check says why
        return ""
    stack: list = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") == "TABLE_FUNCTION":
            name = (node.get("function") or {}).get("function_name", "?")
            return f"reads through the table function {name}(); a predicate reads only its own row's columns"
        if node.get("type") == "BASE_TABLE" and node.get("table_name") not in (WRAPPER, *tables):
            allowed = f" (it may name {', '.join(tables)})" if tables else ""
            return f"reads {node.get('table_name')!r}, not a column of its row{allowed}"
        stack += node.values()
    return ""


WRAPPER = "__predicate_row"  # the table reads_problem parses a predicate over


def predicate_problem(predicate: str, columns: dict[str, str]) -> str:
    """Why `predicate` is not one SQL boolean expression over `columns` (name -> DuckDB type), on
    DuckDB's first error line; "" when it is. Checked on an empty table, with no file access."""
    import duckdb

    if not predicate.strip():
        return "is empty"
    if problem := reads_problem(predicate):
        return problem
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_external_access = false")
        cols = ", ".join(f"NULL::{typ} AS {name}" for name, typ in columns.items())
        con.execute(f"CREATE TABLE t AS SELECT {cols} WHERE false")
        query = f"SELECT count(*) FROM t WHERE ({predicate})"
        if len(con.extract_statements(query)) != 1:
            return "must be one SQL expression"
        con.execute(query).fetchall()
    except duckdb.Error as e:
        return next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    finally:
        con.close()
    return ""
