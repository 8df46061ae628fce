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
