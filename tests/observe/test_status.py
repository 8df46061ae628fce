"""`status` over a long run: the DuckDB queries it makes do not grow with the iterations (one
query per stage over every row of the run, the reward_health pass once), and a damaged file
still shows on its own row alone."""

from __future__ import annotations

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
