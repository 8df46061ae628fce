"""`rlhf-batch sql` and `rlhf-batch status` through typer's CliRunner on a small real run:
Parquet written through the shards API, advantages by the real stage, DuckDB for the queries."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.config import load_config
from rlhf_batch.errors import UserError
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.observe import query as run_query
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import atomic, layout, manifests, output
from rlhf_batch.store.schemas import METRICS, ROLLOUTS, SCORES, with_extra
from tests.stages.test_advantage import EXTRA, R, tables, write_stage

runner = CliRunner()
ROWS = [
    R("p", 0.0, response="ab"),
    R("p", 1.0, "length", response="abcd"),
    R("q", 0.5, response="ab"),
    R("q", 0.5, response="abcd"),
]


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> tuple[Any, Any]:
    return load_model(str(tiny_model), "policy", dtype="float32"), load_tokenizer(str(tiny_model))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, lm: Any) -> Path:
    """iter 0: rollouts, scores, advantages, train complete; iter 1: rollouts partial."""
    root = tmp_path_factory.mktemp("sql") / "run"
    roll, score = tables(lm, 0, ROWS)
    score = score.set_column(score.schema.get_field_index("kl_sum"), "kl_sum", pa.array([0.1, 0.2, 0.3, 0.4]))
    write_stage(str(root), 0, "rollouts", roll, with_extra(ROLLOUTS, EXTRA))
    write_stage(str(root), 0, "scores", score, SCORES)
    run_stage("advantage", load_config(None, [f"run_dir={root}"]), 0, quiet=True)
    train = output.claim(layout.folder(root, 0, "train"), "train", {}, {})
    metrics = {name: [0.0, 0.0] for name in METRICS.names}
    metrics.update(step=[0, 1], loss=[1.0, 0.5], kl_to_ref=[0.1, 0.3], clip_fraction=[0.0, 0.5])
    atomic.write_parquet_atomic(train.sdir / "metrics.parquet", pa.table(metrics), METRICS)
    train.finish(0)
    layout.policy_dir(root, 0).mkdir()
    (layout.policy_dir(root, 0) / "config.json").write_text("{}")
    partial = output.claim(layout.folder(root, 1, "rollouts"), "rollouts", {}, {})
    partial.write_table(
        0, tables(lm, 1, ROWS[:2])[0], with_extra(ROLLOUTS, EXTRA)
    )  # no manifest: interrupted
    return root


def sql(run_dir: Path, query: str | None, *args: str, stdin: str | None = None) -> Any:
    argv = ["sql", "--run-dir", str(run_dir), *args] + ([query] if query is not None else [])
    return runner.invoke(app, argv, input=stdin)


def csv_rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


# ---------------------------------------------------------------- views


def test_views_over_all_iterations_with_iter_column(run: Path) -> None:
    res = sql(run, "SELECT iter, count(*) AS n FROM rollouts GROUP BY iter ORDER BY iter", "-f", "csv")
    assert res.exit_code == 0, res.output
    # only the parts of complete folders, as their manifests list them: iteration 1 is partial
    assert csv_rows(res.stdout) == [["iter", "n"], ["0", "4"]]
    # scores joined to rollouts: mean reward of iteration 0 = (0 + 1 + 0.5 + 0.5) / 4 = 0.5
    res = sql(
        run,
        "SELECT r.iter, avg(s.reward) AS reward, count(*) FILTER (WHERE r.finish_reason = 'length') AS cut "
        "FROM rollouts r JOIN scores s USING (iter, rollout_id) GROUP BY r.iter",
        "-f",
        "csv",
    )
    assert csv_rows(res.stdout) == [["iter", "reward", "cut"], ["0", "0.5", "1"]]
    # q = {0.5, 0.5} has zero variance and is dropped: only p's two rows are training rows
    res = sql(run, "SELECT prompt_id, count(*) AS n FROM advantages GROUP BY ALL", "-f", "csv")
    assert csv_rows(res.stdout) == [["prompt_id", "n"], ["p", "2"]]
    res = sql(run, "SELECT iter, step, loss FROM metrics ORDER BY step", "-f", "csv")
    assert csv_rows(res.stdout) == [["iter", "step", "loss"], ["0", "0", "1.0"], ["0", "1", "0.5"]]


def test_stages_view_has_one_row_per_complete_stage(run: Path) -> None:
    # iteration 1's rollouts have no manifest (interrupted): not a row of `stages`
    query = "SELECT iter, stage, rows, numbers['groups_total'] AS g, numbers['groups_out'] AS k FROM stages"
    res = sql(run, query + " ORDER BY ALL", "-f", "csv")
    assert res.exit_code == 0, res.output
    # advantages: p = {0, 1} kept (2 rows), q = {0.5, 0.5} dropped: 1 of 2 groups; the fixture's
    # train manifest lists no parts, so 0 rows (the real train stage records its steps: next test)
    assert csv_rows(res.stdout) == [
        ["iter", "stage", "rows", "g", "k"],
        ["0", "advantages", "2", "2.0", "1.0"],
        ["0", "rollouts", "4", "", ""],
        ["0", "scores", "4", "", ""],
        ["0", "train", "0", "", ""],
    ]


def test_stages_view_over_a_real_run_matches_the_data(make_config) -> None:
    """generate, score, advantage and train of one iteration, then each stage's numbers in
    `stages` against the same numbers counted from its Parquet output with pyarrow."""
    import pyarrow.compute as pc

    from rlhf_batch.commands.pipeline import run_pipeline

    # no `threads`: in-process it would set torch's thread count for the rest of the pytest process
    path, cfg = make_config(iterations=1, in_process=True)
    run_pipeline(path, [], quiet=True)
    root = Path(cfg.run_dir)
    data = {s: pq.read_table(root / "iter=0000" / s) for s in ("rollouts", "scores", "advantages")}
    query = """SELECT stage, rows, numbers['prompts'] AS prompts, numbers['prompts_truncated'] AS truncated,
        numbers['unscored'] AS unscored, numbers['kl_coef'] AS kl_coef, numbers['groups_total'] AS groups,
        numbers['groups_out'] AS kept, numbers['tokens'] AS tokens, finished, manifest->>'key' AS key
        FROM stages WHERE iter = 0"""
    res = sql(root, query, "-f", "json")
    assert res.exit_code == 0, res.output
    got = {r["stage"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert sorted(got) == ["advantages", "rollouts", "scores", "train"]
    for stage, row in got.items():
        m = manifests.manifest(layout.folder(root, 0, stage))
        assert m is not None and row["key"] == m["key"]
        assert datetime.fromisoformat(row["finished"]) == datetime.strptime(
            m["created"], "%Y-%m-%dT%H:%M:%S%z"
        )
    rollouts, scores, advantages = data["rollouts"], data["scores"], data["advantages"]
    n_prompts = len(pc.unique(rollouts["prompt_id"]))  # 12 demo prompts x 4 generations = 48 rows
    assert (got["rollouts"]["rows"], got["rollouts"]["prompts"]) == (rollouts.num_rows, n_prompts) == (48, 12)
    assert got["rollouts"]["truncated"] == 0
    assert got["scores"]["rows"] == scores.num_rows
    assert got["scores"]["unscored"] == scores["score"].null_count
    assert got["scores"]["kl_coef"] == pc.unique(scores["kl_coef"]).to_pylist()[0]
    assert got["advantages"]["rows"] == advantages.num_rows
    assert got["advantages"]["groups"] == len(pc.unique(scores["prompt_id"]))
    assert got["advantages"]["kept"] == len(pc.unique(advantages["prompt_id"]))
    metrics = pq.read_table(root / "iter=0000/train/metrics.parquet")
    assert got["train"]["rows"] == metrics.num_rows
    assert got["train"]["tokens"] == pc.sum(metrics["tokens"]).as_py()


def test_table_format_and_nested_values(run: Path) -> None:
    res = sql(run, "SELECT rollout_id, prompt_len, input_ids FROM advantages ORDER BY rollout_id")
    assert res.exit_code == 0, res.output
    assert "rollout_id" in res.stdout and "0000-p-0" in res.stdout and "│" in res.stdout
    res = sql(run, "SELECT rollout_id, prompt_ids FROM rollouts WHERE rollout_id = '0000-p-0'", "-f", "json")
    row = json.loads(res.stdout)
    assert row["rollout_id"] == "0000-p-0" and len(row["prompt_ids"]) == len("p=")


def test_views_without_files_are_empty_with_the_schema(tmp_path: Path, lm: Any) -> None:
    write_stage(str(tmp_path), 0, "rollouts", tables(lm, 0, ROWS)[0], with_extra(ROLLOUTS, EXTRA), parts=1)
    res = sql(
        tmp_path,
        "SELECT (SELECT count(*) FROM scores) AS s, (SELECT count(*) FROM advantages) AS a, "
        "(SELECT count(*) FROM metrics) AS m, (SELECT count(*) FROM rollouts) AS r",
        "-f",
        "csv",
    )
    assert csv_rows(res.stdout) == [["s", "a", "m", "r"], ["0", "0", "0", "4"]]
    res = sql(tmp_path, "SELECT column_name FROM (DESCRIBE metrics)", "-f", "csv")
    names = [r[0] for r in csv_rows(res.stdout)[1:]]
    assert names == [*METRICS.names, "iter"]


@pytest.mark.parametrize("suffix", [".json", ".csv", ".parquet"])
def test_out_files_written_by_python(run: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"result{suffix}"
    res = sql(
        run, "SELECT rollout_id, advantage, input_ids FROM advantages ORDER BY rollout_id", "--out", str(out)
    )
    assert res.exit_code == 0, res.output
    if suffix == ".parquet":
        ids = pq.read_table(out)["rollout_id"].to_pylist()
    elif suffix == ".csv":
        ids = [r[0] for r in csv_rows(out.read_text())[1:]]
    else:
        ids = [json.loads(line)["rollout_id"] for line in out.read_text().splitlines()]
    assert ids == ["0000-p-0", "0000-p-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary left behind


def test_csv_nested_values_of_any_type(run: Path) -> None:
    query = "SELECT [1.5, 2.5] AS d, {'a': DATE '2020-01-02'} AS s"
    res = sql(run, query, "-f", "csv")
    assert res.exit_code == 0, res.output
    # decimals and dates inside nested values are written as their text, as in JSON output
    assert csv_rows(res.stdout) == [["d", "s"], ['["1.5", "2.5"]', '{"a": "2020-01-02"}']]


def test_bad_format_and_parquet_to_stdout(run: Path) -> None:
    assert sql(run, "SELECT 1", "-f", "xml").exit_code == 1
    res = sql(run, "SELECT 1", "-f", "parquet")
    assert res.exit_code == 1 and "needs --out" in str(res.exception)
    res = sql(run, "SELECT * FROM no_such_view")
    assert res.exit_code == 1 and "no_such_view" in str(res.exception) and "\n" not in str(res.exception)


# ---------------------------------------------------------------- sandbox


def sandbox_cases(run: Path, outside: Path) -> list[tuple[str, str]]:
    return [
        (f"COPY (SELECT 1 AS x) TO '{run}/evil.csv'", "COPY refused"),
        (f"COPY (SELECT 1 AS x) TO '{outside}/evil.csv'", "COPY refused"),
        (f"EXPORT DATABASE '{run}/export'", "EXPORT refused"),
        (f"ATTACH '{run}/evil.db' AS evil", "ATTACH refused"),
        (f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{run}/evil.csv'", "EXPLAIN refused"),
        (f"SELECT 1; COPY (SELECT 1) TO '{run}/evil.csv'", "exactly one statement"),
        ("CREATE TABLE t AS SELECT 1", "CREATE refused"),
        ("SET enable_external_access = true", "SET refused"),
        ("INSTALL httpfs", "LOAD refused"),
        ("SELECT * FROM read_csv('/etc/passwd')", "Permission Error"),
        ("SELECT * FROM read_text('/etc/passwd')", "Permission Error"),
        (f"SELECT * FROM read_parquet('{outside}/outside.parquet')", "Permission Error"),
        (f"SELECT * FROM read_parquet('{run}/../outside.parquet')", "Permission Error"),
    ]


def test_sandbox_refuses_writes_and_outside_reads(run: Path) -> None:
    outside = run.parent  # a directory next to the run, with a readable Parquet file in it
    pq.write_table(pa.table({"x": [1]}), outside / "outside.parquet")
    before = sorted(str(p) for p in outside.rglob("*"))
    for query, message in sandbox_cases(run, outside):
        res = sql(run, query)
        assert res.exit_code == 1, query
        assert isinstance(res.exception, UserError) and message in str(res.exception), (query, res.exception)
    assert sorted(str(p) for p in outside.rglob("*")) == before  # nothing was written anywhere
    # inside the run, reading any file is allowed (e.g. a manifest)
    res = sql(run, f"SELECT stage FROM read_json('{run}/iter=0000/advantages/_manifest.json')", "-f", "csv")
    assert csv_rows(res.stdout) == [["stage"], ["advantages"]]


def test_duckdb_layer_alone_blocks_outside_access_and_is_locked(run: Path, tmp_path: Path) -> None:
    con = run_query.connect(run)  # the statement filter is not involved here
    try:
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"COPY (SELECT 1) TO '{tmp_path}/x.csv'")
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"ATTACH '{tmp_path}/x.db'")
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("SET enable_external_access = true")
        with pytest.raises(duckdb.Error, match="locked"):
            con.execute("RESET allowed_directories")
        # the run alone: not DuckDB's default temp directory (./.tmp) beside it
        assert con.execute("SELECT current_setting('allowed_directories')").fetchone() == ([f"{run}/"],)
    finally:
        con.close()
    assert list(tmp_path.iterdir()) == []


def test_cli_error_is_one_line_and_exit_1(run: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_batch",
            "sql",
            "--run-dir",
            str(run),
            "SELECT * FROM read_csv('/etc/passwd')",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "RLHF_BATCH_DEBUG": ""},
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: sql: Permission Error") and proc.stderr.count("\n") == 1


def test_views_read_only_the_parts_a_manifest_lists(run: Path, tmp_path: Path) -> None:
    """An orphan part beside a complete folder's parts (a stray copy, a part of another run) is
    not in the view; neither are the parts of a partial folder."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    rollouts = layout.folder(copy, 0, "rollouts")
    shutil.copy(rollouts / layout.part_name(0, 0), rollouts / layout.part_name(0, 7))
    res = sql(copy, "SELECT iter, count(*) AS n FROM rollouts GROUP BY iter ORDER BY iter", "-f", "csv")
    assert res.exit_code == 0, res.output
    assert csv_rows(res.stdout) == [["iter", "n"], ["0", "4"]]


def test_a_query_past_the_time_limit_is_stopped(run: Path) -> None:
    res = sql(run, "SELECT count(*) FROM range(1000000000000)", "--timeout", "1")
    assert res.exit_code == 1
    assert str(res.exception) == "sql: stopped after 1 s (--timeout; 0 for no limit)"


def test_interactive_prompt_reads_queries_until_quit(run: Path) -> None:
    stdin = (
        "SELECT 41 + 1 AS answer;\n"
        f"COPY (SELECT 1) TO '{run}/evil.csv';\n"
        "SELECT\n  count(*) AS advantage_rows\nFROM advantages;\n"
        ".quit\nSELECT 'never' AS after_quit;\n"
    )
    res = sql(run, None, stdin=stdin)
    assert res.exit_code == 0, res.output
    assert "42" in res.stdout and "advantage_rows" in res.stdout and "after_quit" not in res.output
    assert "error: sql: COPY refused" in res.stderr
    assert not (run / "evil.csv").exists()


# ---------------------------------------------------------------- status


def status_lines(run_dir: Path) -> dict[tuple[str, str], str]:
    res = runner.invoke(app, ["status", "--run-dir", str(run_dir)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == f"run: {run_dir.resolve()}" and lines[1].split() == [
        "iter",
        "stage",
        "state",
        "rows",
        "startup_s",
        "work_s",
        "tok/s",
        "stale",
        "details",
    ]
    # without the timing and staleness columns (tests/test_timing.py, tests/stages/test_staleness.py)
    return {(w[0], w[1]): " ".join(w[2:4] + w[8:]) for w in (line.split() for line in lines[2:])}


def test_status_on_a_partial_run(run: Path) -> None:
    s = status_lines(run)
    # responses ab, abcd, ab, abcd: mean length 3; one of four truncated
    assert s["0", "rollouts"] == "complete 4 mean_response_len 3, truncated 0.25"
    # scores 0, 1, 0.5, 0.5 -> 0.5; kl_sum 0.1 .. 0.4 -> 0.25
    assert s["0", "scores"] == "complete 4 mean_score 0.5, mean_reward 0.5, mean_kl 0.25, unscored 0"
    # p = {0, 1}: mean 0.5, std sqrt(0.5) = 0.7071068; |adv| = 0.5 / (0.7071068 + 1e-6) = 0.7071058
    assert (
        s["0", "advantages"]
        == "complete 2 groups 1, mean_reward 0.5, mean_abs_advantage 0.7071, kept 1/2 groups"
    )
    # loss 1.0 then 0.5; kl_to_ref (0.1 + 0.3) / 2 = 0.2; clip (0 + 0.5) / 2 = 0.25, also its median,
    # above the health threshold 0.2; ESS 0 on both steps: 100% below 0.5
    assert s["0", "train"] == (
        "complete 2 final_loss 0.5, mean_kl_to_ref 0.2, mean_clip_fraction 0.25, HEALTH: median "
        "clip_fraction 0.25 > 0.20; ESS < 0.5 on 100% of steps (> 50%), policy saved"
    )
    assert s["1", "rollouts"].startswith("partial 2 ")
    assert [s["1", st] for st in ("scores", "advantages", "train")] == ["missing -"] * 3


def test_status_shows_only_eval_for_the_iteration_after_the_last(run: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "iter=0001")
    output.claim(layout.folder(copy, 1, "eval"), "eval", {}, {}).finish(0)  # eval of iteration 0's policy
    s = status_lines(copy)
    assert [k for k in s if k[0] == "1"] == [
        ("1", "eval")
    ]  # no "missing" rollouts, scores, ... after the last
    assert s["1", "eval"].startswith("complete")


def test_status_of_an_empty_and_a_missing_run_dir(tmp_path: Path) -> None:
    res = runner.invoke(app, ["status", "--run-dir", str(tmp_path)])  # a directory holding no run
    assert res.exit_code == 1 and f"{tmp_path}: holds no run (no iter=* folder)" in str(res.exception)
    res = runner.invoke(app, ["status", "--run-dir", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "run directory not found" in str(res.exception)


def test_every_sql_example_of_the_docs_runs(run: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "inspecting.md").read_text()
    block = readme.split("```sql\n", 1)[1].split("```", 1)[0]
    queries = [q.strip() for q in re.sub(r"^--.*$", "", block, flags=re.M).split(";") if q.strip()]
    assert len(queries) == 6  # reward, worst, zero variance, length, training, stage records
    for q in queries:
        res = sql(run, q, "-f", "csv")
        assert res.exit_code == 0, f"{q}\n{res.output}"
        # the fixture's iteration 0 has rows for each: a header line, then at least one row
        assert len(res.stdout.strip().splitlines()) >= 2, f"{q}\n{res.output}"


def test_report_figures_integer_ticks_train_panels_and_no_offset(
    run: Path, tmp_path: Path, monkeypatch
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from rlhf_batch.observe.report import write_report

    saved: dict[str, Figure] = {}  # by the name of the PNG the report writes (through a temporary)
    real = Figure.savefig

    def keep(self: Figure, fname: object, *a: object, **k: object) -> None:
        names = ("reward", "kl", "length", "filtered", "train", "eval", "time")
        name = next(n for n in names if f".{n}.png" in str(fname) or str(fname).endswith(f"/{n}.png"))
        saved[f"{name}.png"] = self
        real(self, fname, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    write_report(run, tmp_path / "report")
    titles = [ax.get_title() for ax in saved["train.png"].axes if ax.get_visible()]
    assert titles[:3] == ["loss", "grad_norm", "lr"] and "ess" in titles
    for name, fig in saved.items():
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            if ax.get_xlabel().startswith(("iteration", "train step")):
                assert all(float(t).is_integer() for t in ticks), (name, ticks)
            if name == "train.png":
                assert ax.yaxis.get_major_formatter().get_useOffset() is False, ax.get_title()
