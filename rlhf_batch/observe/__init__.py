"""L3, looking at a run: live tracking, the SQL views and REPL (query), status, the report."""
