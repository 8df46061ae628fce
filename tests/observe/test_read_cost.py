"""`status` over a long run: the DuckDB queries it makes do not grow with the iterations (one
query per stage over every row of the run, the reward_health pass once), and a damaged file
still shows on its own row alone."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.observe.status import print_status
from rlhf_batch.store import layout, manifests

runner = CliRunner()


class Counting:
    """A DuckDB connection that records each statement run on it (execute, sql)."""

    def __init__(self, con: Any, log: list[str]) -> None:
        self._con, self._log = con, log

    def execute(self, query: str, *args: Any, **kw: Any) -> Any:
        self._log.append(query)
        return self._con.execute(query, *args, **kw)

    def sql(self, query: str, *args: Any, **kw: Any) -> Any:
        self._log.append(query)
        return self._con.sql(query, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


def status_statements(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> list[str]:
    """The statements every DuckDB connection `status` opens runs, over the run `root`."""
    log: list[str] = []
    real = duckdb.connect
    with monkeypatch.context() as m:
        m.setattr(duckdb, "connect", lambda *a, **kw: Counting(real(*a, **kw), log))
        print_status(root)
    capsys.readouterr()
    return log


@pytest.mark.slow
def test_status_queries_do_not_grow_with_the_iterations(make_config, monkeypatch, capsys, tmp_path) -> None:
    """A real 6-iteration run with two reward parts (so reward_health computes each part's share
    of reward_raw's variance) and the same run cut to its first 3 iterations: `status` runs as
    many DuckDB statements over both (4 stage rows per iteration: 12 against 24 rows)."""
    functions = ["tests.stages.test_score:length_reward", "tests.stages.test_score:token_reward"]
    path, cfg = make_config(score={"reward_functions": functions}, in_process=True)
    r = runner.invoke(app, ["run", str(path), "--iterations", "6", "--quiet"])
    assert r.exit_code == 0, r.output
    six = Path(cfg.run_dir)
    counts = (manifests.manifest(layout.folder(six, 5, "scores")) or {}).get("counts") or {}
    assert {"unscored_reward_length_reward", "unscored_reward_token_reward"} <= set(counts), counts
    three = tmp_path / "three"
    for it in range(3):
        shutil.copytree(layout.iter_dir(six, it), layout.iter_dir(three, it))
    few = status_statements(three, monkeypatch, capsys)
    many = status_statements(six, monkeypatch, capsys)
    assert len(many) == len(few), f"{len(few)} statements over 3 iterations, {len(many)} over 6"
    print_status(six)
    lines = capsys.readouterr().out.splitlines()
    assert sum(" complete " in x for x in lines) == 6 * 4  # every row there, each with its numbers
    assert sum("mean_score " in x for x in lines) == 6


def test_a_damaged_part_shows_on_its_row_alone(tmp_path, capsys) -> None:
    """Two partial rollouts folders (no manifest: their parts are read as they are on disk), one
    of them holding a part whose footer is sound and whose data is not: its row says it cannot
    be read, the other keeps its numbers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "run"
    table = pa.table({"response_ids": [[1, 2], [3, 4, 5, 6]], "finish_reason": ["stop", "length"]})
    for it in (0, 1):
        sdir = layout.folder(root, it, "rollouts")
        sdir.mkdir(parents=True)
        pq.write_table(table, sdir / "part-00000-00000.parquet")
    damaged = layout.folder(root, 1, "rollouts") / "part-00001-00000.parquet"
    pq.write_table(table, damaged)
    data = bytearray(damaged.read_bytes())
    data[4:40] = b"\xff" * 36  # the first column chunk's page, after the magic bytes
    damaged.write_bytes(bytes(data))
    assert pq.ParquetFile(damaged).metadata.num_rows == 2  # its footer reads
    print_status(root)
    rows = {tuple(x.split()[:2]): x.split(maxsplit=8)[2:] for x in capsys.readouterr().out.splitlines()[2:]}
    # lengths 2 and 4: mean 3; one of the two ended for length
    assert rows["0", "rollouts"] == ["partial", "2", "-", "-", "-", "-", "mean_response_len 3, truncated 0.5"]
    state, n, *_, details = rows["1", "rollouts"]
    assert (state, n) == ("partial", "4") and details.startswith("unreadable (")


def test_a_view_without_files_has_the_types_duckdb_reads_from_parquet(tmp_path) -> None:
    """A view with no file yet is an empty table written out in SQL (query.empty_table): each
    column has the type DuckDB itself gives it reading an empty Parquet file of that schema."""
    import pyarrow.parquet as pq

    from rlhf_batch.observe.query import VIEWS, empty_table
    from rlhf_batch.store import schemas

    con = duckdb.connect()
    for name, (_, schema_name) in VIEWS.items():
        schema = getattr(schemas, schema_name)
        pq.write_table(schema.empty_table(), tmp_path / f"{name}.parquet")
        empty_table(con, name, schema, ["iter"])
        ours = con.execute(f"DESCRIBE {name}").fetchall()
        theirs = con.execute(
            f"DESCRIBE SELECT *, NULL::INTEGER AS iter FROM '{tmp_path / name}.parquet'"
        ).fetchall()
        assert [r[:2] for r in ours] == [r[:2] for r in theirs], name


def test_sql_and_status_do_not_import_pandas(tmp_path) -> None:
    """pandas is ~0.5 s of imports: DuckDB imports it when handed an Arrow table, so the empty
    views and reward_health are written in SQL. A process of its own, over a run with an empty
    view (no metrics) and the reward_health table queried."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_batch.store import output
    from rlhf_batch.store.schemas import ROLLOUTS

    root = tmp_path / "run"
    rollouts = output.claim(layout.folder(root, 0, "rollouts"), "rollouts", {}, {})
    rollouts.write_table(
        0,
        pa.table({n: pa.array([], t) for n, t in zip(ROLLOUTS.names, ROLLOUTS.types, strict=True)}),
        ROLLOUTS,
    )
    rollouts.finish(0)
    assert pq.read_table(layout.folder(root, 0, "rollouts")).num_rows == 0
    code = (
        "import sys; from rlhf_batch.observe.query import run_sql; from rlhf_batch.observe.status import print_status; "
        f"run_sql({str(root)!r}, 'SELECT count(*) FROM reward_health, metrics'); print_status({str(root)!r}); "
        "assert 'pandas' not in sys.modules, 'pandas imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("n, bars", [(3, True), (201, False)])
def test_time_plot_of_a_long_run_draws_one_area_per_layer(n: int, bars: bool, tmp_path, monkeypatch) -> None:
    """time.png: a bar per iteration and layer (stage x start-up/work) up to report.BARS_UP_TO
    iterations; past it, where a bar is narrower than a pixel, one stepped area per layer (8,000
    bar patches took most of the report's time over 1,000 iterations)."""
    import matplotlib.pyplot as plt

    from rlhf_batch.observe import report

    stages = {"rollouts": {"startup_s": 0.5, "work_s": 1.0}, "train": {"startup_s": 0.2, "work_s": 2.0}}
    data = {"iters": [{"iter": it, "time": stages} for it in range(n)]}
    drawn: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (drawn.append(fig), close(fig)))
    assert report._time_plot(data, tmp_path) == ["time.png"]
    ax = drawn[0].axes[0]
    layers = 4  # rollouts and train, each start-up and work
    if bars:
        assert (len(ax.patches), len(ax.collections)) == (n * layers, 0)
    else:
        assert (len(ax.patches), len(ax.collections)) == (0, layers)
    assert ax.get_ylim()[1] == pytest.approx(3.7 * 1.08)  # the stack: 0.5 + 1 + 0.2 + 2, with room above


@pytest.mark.parametrize(
    "query, views",
    [
        ("SELECT iter, avg(score) FROM scores GROUP BY iter", {"scores"}),
        (
            "SELECT * FROM Health h JOIN main.stages s USING (iter) WHERE s.iter IN (SELECT iter FROM eval)",
            {"health", "stages", "eval"},
        ),
        ("SELECT * FROM reward_health", {"reward_health"}),
        ("SELECT 1", set()),
        ("WITH t AS (SELECT * FROM scores) SELECT * FROM t", None),  # t: no view
        ("SHOW TABLES", None),
        ("DESCRIBE scores", None),
        ("SELECT * FROM information_schema.tables", None),
        ("SELECT * FROM read_parquet('iter=0000/scores/part-00000-00000.parquet')", None),
        ("SELECT * FROM 'iter=0000/scores/part-00000-00000.parquet'", None),
        ("SELECT * FROM scorez", None),
        ("SELECT FROM WHERE", None),
    ],
)
def test_views_a_query_reads(query: str, views: set[str] | None) -> None:
    """`sql` makes the views its one query reads (and those they read) alone; where DuckDB's parse
    cannot tell (None) it makes every view, as for a query from stdin."""
    from rlhf_batch.observe.query import views_named

    assert views_named(query) == views


def test_sql_of_one_view_reads_that_view_s_files_alone(tmp_path, monkeypatch, capsys) -> None:
    """An aggregate over scores makes no other view (on a long run each binds thousands of files);
    reward_health still finds every view it reads."""
    import json

    import pyarrow as pa

    from rlhf_batch.observe.query import run_sql
    from rlhf_batch.store import output
    from rlhf_batch.store.schemas import ROLLOUTS, SCORES

    root = tmp_path / "run"
    for stage, schema in (("rollouts", ROLLOUTS), ("scores", SCORES)):
        out = output.claim(layout.folder(root, 0, stage), stage, {}, {})
        out.write_table(
            0, pa.table({n: pa.array([], t) for n, t in zip(schema.names, schema.types, strict=True)}), schema
        )
        out.finish(0)
    log: list[str] = []
    real = duckdb.connect
    with monkeypatch.context() as m:
        m.setattr(duckdb, "connect", lambda *a, **kw: Counting(real(*a, **kw), log))
        run_sql(root, "SELECT count(*) AS n FROM scores", fmt="json")
    assert json.loads(capsys.readouterr().out) == {"n": 0}
    made = {m.group(1) for q in log if (m := re.match(r"CREATE (?:VIEW|TABLE) (\w+)", q))}
    assert made == {"scores"}
    run_sql(root, "SELECT count(*) AS n FROM reward_health", fmt="json")
    assert json.loads(capsys.readouterr().out) == {"n": 0}
