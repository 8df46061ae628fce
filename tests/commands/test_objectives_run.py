"""A run that schedules its objectives (SFT, then DPO, then GRPO), through the CLI as users run
it: what `status`, `sql` (the objectives and advantages views), `report` and `export --pairs`
say of which objective trained each iteration, and on which rows."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from rlhf_batch.observe import query as run_query
from rlhf_batch.observe.status import print_status
from tests.stages.test_import_messages import cli, msg

SCHEDULE = {
    "iterations": 3,
    "in_process": True,
    "generate": {"prompts_per_iteration": 4, "num_generations": 4, "max_new_tokens": 4},
    "train": {"objective": ["sft:1", "dpo:1", "grpo"], "lr": 1e-3},
    "advantage": {"select": {"best": 1}},
}


def test_a_scheduled_run_shows_each_iterations_objective_and_rows(
    make_config, tmp_path: Path, capfd, monkeypatch
) -> None:
    path, cfg = make_config(**SCHEDULE)
    code, err = cli(capfd, monkeypatch, ["run", str(path), "-q"])
    assert code == 0, err
    con = run_query.connect(cfg.run_dir)
    try:
        got = con.execute("SELECT iter, objective, rows, pairs FROM objectives ORDER BY iter").fetchall()
        adv = con.execute(
            "SELECT iter, count(*), count(pair), count(DISTINCT prompt_id) FROM advantages GROUP BY iter ORDER BY iter"
        ).fetchall()
        pairs = con.execute(
            "SELECT c.rollout_id, r.rollout_id FROM advantages c JOIN advantages r USING (iter, pair) "
            "WHERE iter = 1 AND c.chosen AND NOT r.chosen ORDER BY pair"
        ).fetchall()
    finally:
        con.close()
    assert [(i, o) for i, o, _, _ in got] == [(0, "sft"), (1, "dpo"), (2, "grpo")]
    by_iter = {it: rest for it, *rest in adv}
    (sft_rows, _, sft_prompts), (dpo_rows, dpo_paired, _) = by_iter[0], by_iter[1]
    assert sft_rows == sft_prompts == got[0][2] == 4  # best-of-4: one row per prompt, each trained
    assert dpo_rows == dpo_paired == 2 * got[1][3] == got[1][2] > 0  # two rows a pair, all trained
    grpo_rows, grpo_paired, _ = by_iter.get(2, (0, 0, 0))  # (every group of equal rewards: none)
    assert grpo_paired == 0 and grpo_rows == got[2][2] and got[2][3] is None
    # status: the objective on the train rows, the rows chosen on the advantages rows
    capfd.readouterr()
    print_status(cfg.run_dir)
    out = capfd.readouterr().out
    lines = {
        tuple(line.split()[:2]): line
        for line in out.splitlines()
        if line.split()[:1] in (["0"], ["1"], ["2"])
    }
    assert "objective sft" in lines[("0", "train")] and f"sft: {sft_rows} of" in lines[("0", "advantages")]
    assert (
        "objective dpo" in lines[("1", "train")] and f"dpo: {got[1][3]} pairs" in lines[("1", "advantages")]
    )
    assert "objective" not in lines[("2", "train")]
    html = (Path(cfg.run_dir) / "report" / "report.html").read_text()
    assert "<th>objective</th>" in html and "<td>dpo</td>" in html and "<td>grpo</td>" in html
    # export --pairs: the pairs DPO trained on, as messages
    code, err = cli(
        capfd, monkeypatch, ["export", str(path), "--iter", "1", "--pairs", "--out", str(tmp_path / "p")]
    )
    assert code == 0, err
    rows = pq.read_table(tmp_path / "p" / "data" / "train-00000-of-00001.parquet").to_pylist()
    assert [(r["chosen_id"], r["rejected_id"]) for r in rows] == pairs
    con = duckdb.connect()
    texts = dict(
        con.execute(
            f"SELECT rollout_id, response FROM read_parquet('{cfg.run_dir}/iter=0001/rollouts/*.parquet')"
        ).fetchall()
    )
    for r in rows:
        assert r["chosen"] == [msg("assistant", texts[r["chosen_id"]])]
        assert r["rejected"] == [msg("assistant", texts[r["rejected_id"]])]
        assert r["prompt"][0]["role"] == "user" and r["chosen_reward"] > r["rejected_reward"]
