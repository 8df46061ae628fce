"""Train's per-rollout diagnostics as `sql` and the report see them, and the masked share in the
`health` view: real Parquet files under complete manifests, figures worked out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rlhf_batch.observe import health as run_health
from rlhf_batch.observe import query as run_query
from rlhf_batch.observe.report import write_report
from rlhf_batch.store import atomic, layout, output
from rlhf_batch.store.schemas import METRICS, ROLLOUT_STATS, ROLLOUTS


def write_train(
    root: Path, it: int, metrics: dict[str, list[Any]], schema: pa.Schema = METRICS
) -> output.StageOutput:
    train = output.claim(layout.folder(root, it, "train"), "train", {}, {})
    n = len(metrics["ess"])
    cols: dict[str, list[Any]] = {name: [0.0] * n for name in schema.names}
    cols.update(step=list(range(n)), epoch=[0] * n, tokens=[10] * n, sequences=[2] * n, **metrics)
    atomic.write_parquet_atomic(train.sdir / layout.METRICS_FILE, pa.table(cols), schema)
    return train


def write_rollouts(root: Path, it: int, ids: list[str]) -> None:
    out = output.claim(layout.folder(root, it, "rollouts"), "generate", {}, {})
    n = len(ids)
    table = pa.table(
        {
            "rollout_id": ids,
            "prompt_id": ["p"] * n,
            "sample_idx": list(range(n)),
            "prompt": ["c*3="] * n,
            "prompt_ids": [[5, 6]] * n,
            "response": [f"answer {i}" for i in ids],
            "response_ids": [[7, 8]] * n,
            "behavior_logprobs": [[-0.5, -0.5]] * n,
            "finish_reason": ["stop"] * n,
            "policy": ["p0"] * n,
        },
        schema=ROLLOUTS,
    )
    out.write_table(0, table, ROLLOUTS)
    out.finish(1)


def stats_row(rid: str, diff: float, masked: int) -> dict[str, Any]:
    return {
        "rollout_id": rid, "epoch": 0, "step": 0, "tokens": 2, "ratio_mean": 1.0, "ratio_max": 1.0,
        "is_weight": 1.0, "clipped_tokens": 0, "masked_tokens": masked, "entropy_mean": 2.0,
        "logprob_diff_max": diff,
    }  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Iteration 0: metrics written before `tis_masked` existed and no rollout_stats; iteration 1:
    tis_masked 0.1, 0.3 (mean 0.2) and three rollouts' diagnostics."""
    root = tmp_path_factory.mktemp("stats") / "run"
    old_schema = pa.schema([f for f in METRICS if f.name != "tis_masked"])
    write_train(root, 0, {"ess": [1.0, 1.0]}, old_schema).finish(0, {"rows": 2})
    ids = ["0001-a-0", "0001-a-1", "0001-b-0"]
    write_rollouts(root, 1, ids)
    train = write_train(root, 1, {"ess": [1.0, 1.0], "tis_masked": [0.1, 0.3]})
    rows = [stats_row(ids[0], 0.02, 0), stats_row(ids[1], 0.9, 1), stats_row(ids[2], 0.3, 0)]
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_STATS)
    atomic.write_parquet_atomic(train.sdir / layout.ROLLOUT_STATS_FILE, table, ROLLOUT_STATS)
    train.finish(0, {"rows": 2})
    return root


def query(root: Path, sql: str) -> list[tuple[Any, ...]]:
    con = run_query.connect(root)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_rollout_stats_view_joins_rollouts_on_rollout_id(run: Path) -> None:
    got = query(
        run,
        "SELECT s.iter, r.response, s.logprob_diff_max, s.masked_tokens FROM rollout_stats s "
        "JOIN rollouts r USING (rollout_id) ORDER BY s.logprob_diff_max DESC",
    )
    assert got == [
        (1, "answer 0001-a-1", 0.9, 1),
        (1, "answer 0001-b-0", 0.3, 0),
        (1, "answer 0001-a-0", 0.02, 0),
    ]


def test_health_has_the_masked_share_and_reads_metrics_without_it(run: Path) -> None:
    con = run_query.connect(run)
    try:
        rows = {r["iter"]: r for r in run_health.rows(con)}
    finally:
        con.close()
    assert rows[0]["tis_masked"] is None  # written before the column existed
    assert rows[1]["tis_masked"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2
    assert run_health.iteration_warning(run, 1) is None


def test_an_old_run_alone_still_has_the_health_view(tmp_path: Path) -> None:
    old_schema = pa.schema([f for f in METRICS if f.name != "tis_masked"])
    write_train(tmp_path / "old", 0, {"ess": [1.0]}, old_schema).finish(0, {"rows": 1})
    assert query(tmp_path / "old", "SELECT iter, tis_masked FROM health") == [(0, None)]
    assert query(tmp_path / "old", "SELECT count(*) FROM rollout_stats") == [(0,)]  # the empty table


def test_report_names_the_rollouts_of_largest_mismatch(run: Path, tmp_path: Path) -> None:
    page = write_report(run, tmp_path / "report").read_text()
    section = page.split("<h2>Largest trainer/behaviour mismatch</h2>", 1)[1]
    first, second = section.index("0001-a-1"), section.index("0001-b-0")
    assert first < second < section.index("0001-a-0")  # 0.9, 0.3, 0.02
    assert "<pre>answer 0001-a-1</pre>" in section
