"""generate.prompt_filter: a batch's prompts are skipped by their pass rate over earlier
iterations' scores, the skipped ones recorded; `sql`'s prompt_stats view. Real in-process runs
of the tiny model; the expected numbers are worked out from the score files with plain Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.config import load_config
from rlhf_batch.data import curriculum
from rlhf_batch.errors import ConfigError
from rlhf_batch.runtime import faults
from rlhf_batch.store import layout, manifests

runner = CliRunner()
SCORE = {"reward_functions": ["tests.data.test_curriculum:by_count"], "kl_in_reward": False}


def by_count(*, count: list[int], response_ids: list[list[int]], **_: Any) -> list[float]:
    """count % 3 == 0: always 1 (pass rate 1); == 1: always 0 (pass rate 0); else the parity of
    the first response token (a pass rate in between, most of the time)."""
    out = []
    for n, ids in zip(count, response_ids, strict=True):
        out.append(1.0 if n % 3 == 0 else 0.0 if n % 3 == 1 else float(ids[0] % 2) if ids else 0.0)
    return out


def configure(make_config, where: Path, name: str, iterations: int, **generate: Any) -> tuple[Path, Any]:
    return make_config(
        name=f"{name}.toml",
        run_dir=str(where / name),
        iterations=iterations,
        in_process=True,
        generate={"prompts_per_part": 5, **generate},
        score=SCORE,
        train={"lr": 1e-3},
    )


def scores(run_dir: str, its: list[int]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for it in its:
        for row in pq.read_table(layout.folder(run_dir, it, "scores")).to_pylist():
            out[row["prompt_id"]].append(row["score"])
    return out


def sampled(run_dir: str, it: int) -> list[str]:
    rows = pq.read_table(layout.folder(run_dir, it, "rollouts")).to_pylist()
    return list(dict.fromkeys(r["prompt_id"] for r in rows))


@pytest.mark.slow
def test_band_skips_prompts_by_earlier_pass_rates_and_records_them(
    make_config, demo_prompts, tmp_path
) -> None:
    path, cfg = configure(make_config, tmp_path, "band", 3, prompt_filter=[0.2, 0.8])
    run_pipeline(path, [], quiet=True)
    file_ids = [json.loads(line)["id"] for line in demo_prompts.read_text().splitlines()]
    for it in (0, 1, 2):
        # history: iterations 0 .. it-1; pass = score > 0.5; kept: 0.2 <= passes / attempts <= 0.8
        hist = scores(cfg.run_dir, list(range(it)))
        rate = {p: sum(s > 0.5 for s in v) / len(v) for p, v in hist.items()}
        expected_skip = [p for p in file_ids if p in rate and not 0.2 <= rate[p] <= 0.8]
        m = manifests.manifest(layout.folder(cfg.run_dir, it, "rollouts"))
        assert m["prompt_filter"]["skipped"] == expected_skip, it
        assert m["prompt_filter"]["history"] == ([0, it - 1] if it else [])
        assert m["prompt_counts"]["prompts_skipped_filter"] == len(expected_skip)
        assert sampled(cfg.run_dir, it) == [p for p in file_ids if p not in expected_skip]
        assert "prompt_filter" in m["inputs"]
    # the demo counts 1..4 give each class: count 3 passes always, counts 1 and 4 never
    assert len(manifests.manifest(layout.folder(cfg.run_dir, 1, "rollouts"))["prompt_filter"]["skipped"]) >= 6

    # sql's prompt_stats: attempts, mean score, pass rate (score > 0.5), last iteration, per prompt
    res = runner.invoke(
        app, ["sql", "--run-dir", cfg.run_dir, "SELECT * FROM prompt_stats ORDER BY prompt_id", "-f", "json"]
    )
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    allh = scores(cfg.run_dir, [0, 1, 2])
    last = {p: max(it for it in (0, 1, 2) if p in sampled(cfg.run_dir, it)) for p in allh}
    assert got == [
        {
            "prompt_id": p,
            "attempts": len(allh[p]),
            "mean_score": pytest.approx(sum(allh[p]) / len(allh[p])),
            "pass_rate": pytest.approx(sum(s > 0.5 for s in allh[p]) / len(allh[p])),
            "last_iter": last[p],
        }
        for p in sorted(allh)
    ]


def test_predicate_is_checked_and_off_leaves_no_trace(make_config, tmp_path) -> None:
    path, _ = configure(make_config, tmp_path, "bad", 1)
    for value, words in [
        ('"pass_rat > 0.2"', "pass_rat"),
        ('"pass_rate > 0.2; SELECT 1"', "generate.prompt_filter"),
        ("[0.9, 0.2]", "lo <= hi"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(path, [f"generate.prompt_filter={value}"])
        assert "generate.prompt_filter" in str(e.value) and words in str(e.value)
        assert "\n" not in str(e.value)
    ok = load_config(path, ['generate.prompt_filter="attempts < 4 OR pass_rate BETWEEN 0.1 AND 0.9"'])
    assert ok.generate.prompt_filter.startswith("attempts")
    from rlhf_batch.stages.registry import run_stage

    m = run_stage("generate", load_config(path), 0, quiet=True)
    assert "prompt_filter" not in m and "prompt_filter" not in m["inputs"]
    assert "prompts_skipped_filter" not in m["prompt_counts"]


@pytest.mark.slow
def test_a_killed_filtered_generate_resumes_to_the_same_prompts(make_config, tmp_path) -> None:
    flt = "pass_rate BETWEEN 0.2 AND 0.8"
    ref_path, ref = configure(make_config, tmp_path, "ref", 2, prompt_filter=flt)
    run_pipeline(ref_path, [], quiet=True)
    path, cfg = configure(make_config, tmp_path, "killed", 1, prompt_filter=flt)
    run_pipeline(path, [], quiet=True)
    env = {
        **os.environ,
        faults.FAULT_ENV: "rollouts:part-0:done",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    cmd = [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--iter", "1", "--quiet"]
    cmd += ["--set", "iterations=2"]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "rollouts")) is None
    run_pipeline(path, ["iterations=2"], quiet=True)
    for folder in ("rollouts", "scores", "advantages"):
        a, b = (pq.read_table(layout.folder(d, 1, folder)) for d in (cfg.run_dir, ref.run_dir))
        drop = ["policy"] if folder == "rollouts" else []
        assert a.drop_columns(drop).equals(b.drop_columns(drop)), folder
    ma, mb = (manifests.manifest(layout.folder(d, 1, "rollouts")) for d in (cfg.run_dir, ref.run_dir))
    assert ma["prompt_filter"] == mb["prompt_filter"] and ma["prompt_filter"]["skipped"]


def write_scores(run_dir: str, it: int, passed: dict[str, list[float]]) -> None:
    """A complete scores folder of iteration `it` with the given scores per prompt."""
    from rlhf_batch.store import output
    from rlhf_batch.store.schemas import SCORES

    rows = [(p, s) for p, ss in passed.items() for s in ss]
    cols = {
        "rollout_id": [f"{it}-{p}-{k}" for k, (p, _) in enumerate(rows)],
        "prompt_id": [p for p, _ in rows],
        "score": [s for _, s in rows],
    }
    table = pa.table({f.name: cols.get(f.name, [None] * len(rows)) for f in SCORES}, schema=SCORES)
    out = output.claim(layout.folder(run_dir, it, "scores"), "scores", {"it": it}, {})
    out.write_table(0, table, SCORES)
    out.finish(1)


def test_the_history_leaves_out_the_iterations_the_policy_has_not_trained_on(make_config, tmp_path) -> None:
    """max_staleness = 1: iteration 2 samples from the policy trained on iteration 0 only, so its
    filter reads iteration 0's scores and not iteration 1's."""
    path, _ = configure(make_config, tmp_path, "stale", 3, prompt_filter=[0.2, 0.8])
    cfg = load_config(path, ["max_staleness=1"])
    # a: passed 1 of 2 in iteration 0 (rate 0.5, kept), failed 4 times in iteration 1 (would be 1/6)
    # b: passed twice in iteration 0 (rate 1, skipped), failed twice in iteration 1 (would be 2/4)
    # c: only in iteration 1 (no history: kept; would be rate 0, skipped)
    write_scores(cfg.run_dir, 0, {"a": [1.0, 0.0], "b": [1.0, 1.0]})
    write_scores(cfg.run_dir, 1, {"a": [0.0] * 4, "b": [0.0, 0.0], "c": [0.0, 0.0]})
    assert curriculum.history(cfg, 2) == [0]
    assert curriculum.skipped(cfg, 2, ["a", "b", "c"]) == ["b"]
    # without staleness iteration 2 trains on both: a 1/6 and c 0/2 skipped, b 2/4 kept
    fresh = load_config(path, ["max_staleness=0"])
    assert curriculum.skipped(fresh, 2, ["a", "b", "c"]) == ["a", "c"]


def test_refill_takes_the_next_batch_of_each_source_to_its_quota(make_config, demo_prompts, tmp_path) -> None:
    """prompt_filter_refill: the prompts the filter skips are replaced from the next batch of the
    order, each source to its quota, skipped prompts left out there too; the batch it read counts
    as taken. Without it the batch shrinks and a source loses its share."""
    from rlhf_batch.core.mixtures import rows_for
    from rlhf_batch.data import topup
    from rlhf_batch.stages.generate import Generate
    from rlhf_batch.store import output
    from tests.data.test_mixtures import split

    _, _, ids_a, ids_b = split(demo_prompts, tmp_path)
    sources = [
        {"path": "a.jsonl", "weight": 1.0, "name": "a"},
        {"path": "b.jsonl", "weight": 1.0, "name": "b"},
    ]
    path, cfg = configure(
        make_config, tmp_path, "refill", 3, prompts=sources, prompts_per_iteration=4, prompt_filter=[0.2, 0.8]
    )
    ids = ids_a + ids_b  # the rows of the concatenated set, source a's first
    sizes = [len(ids_a), len(ids_b)]
    # weights 1:1 of 4: quotas 2 and 2; iteration 1 takes batch 1 (iteration 0 took batch 0)
    batch = {k: [ids[r] for r in rows_for(k, sizes, [1.0, 1.0], 4, cfg.seed)[1]] for k in (1, 2, 3)}
    a1, b1, a2, a3 = batch[1][:2], batch[1][2:], batch[2][:2], batch[3][:2]
    # history (iteration 0): both `a` prompts of batch 1 and the first `a` of batch 2 always
    # failed (pass rate 0: skipped by the band); every other prompt has no history (kept)
    write_scores(cfg.run_dir, 0, {a1[0]: [0.0, 0.0], a1[1]: [0.0, 0.0], a2[0]: [0.0, 0.0]})

    def plan(config: Any) -> Generate:
        g = Generate(config, 1)
        g.policy, g.batch = config.policy_model, topup.batch_index(config, 1, 0)
        g.plan()
        return g

    shrunk = plan(cfg)
    assert shrunk.prompts.ids == b1  # 2 of 4, and source `a` is gone
    g = plan(load_config(path, ["generate.prompt_filter_refill=3"]))
    # batch 1's kept prompts; then `a` only (b has its quota): batch 2's second `a` (its first
    # failed), batch 3's first `a`; batch 4 is not read (the batch is full)
    assert g.prompts.ids == [*b1, a2[1], a3[0]]
    assert g.prompts.carried["source"].to_pylist() == ["b", "b", "a", "a"]  # quotas 2 and 2
    assert g.filtered["skipped"] == a1
    assert g.filtered["refill"] == {"batches": [2, 3], "prompts": [a2[1], a3[0]]}
    assert g.prompts.counts["prompts_refilled"] == 2 and g.prompts.batch["refill"] == [2, 3]
    # the batches it read count as taken: the next iteration (or round) starts at batch 4
    out = output.claim(layout.folder(cfg.run_dir, 1, "rollouts"), "rollouts", {"it": 1}, {})
    out.write_table(0, pa.table({"x": [1]}), pa.schema([("x", pa.int64())]))
    out.finish(1, {"prompt_batch": g.prompts.batch})
    assert topup.batch_index(cfg, 2, 0) == 4 and topup.batch_index(cfg, 1, 1) == 4
    with pytest.raises(ConfigError, match="generate.prompt_filter_refill"):
        load_config(path, ["generate.prompt_filter_refill=1", 'generate.prompt_filter=""'])


def test_a_window_bounds_the_history(make_config, tmp_path) -> None:
    """generate.prompt_filter_window = 1: iteration 2's filter reads iteration 1's scores alone
    (what a long run's iteration reads stays the same), and the window is in generate's inputs."""
    path, _ = configure(make_config, tmp_path, "window", 3, prompt_filter=[0.2, 0.8])
    cfg = load_config(path, ["generate.prompt_filter_window=1"])
    # a: passed twice in iteration 0, 1 of 2 in iteration 1: over both 3/4 (kept), alone 1/2 (kept)
    # b: failed twice in iteration 0, passed 1 of 2 in iteration 1: over both 1/4 (kept), alone 1/2
    # c: passed 1 of 2 in iteration 0, failed twice in iteration 1: 1/4 over both (kept), 0 alone
    write_scores(cfg.run_dir, 0, {"a": [1.0, 1.0], "b": [0.0, 0.0], "c": [1.0, 0.0]})
    write_scores(cfg.run_dir, 1, {"a": [1.0, 0.0], "b": [1.0, 0.0], "c": [0.0, 0.0]})
    assert curriculum.history(cfg, 2) == [1]
    assert curriculum.skipped(cfg, 2, ["a", "b", "c"]) == ["c"]
    every = load_config(path)  # window 0: iterations 0 and 1
    assert curriculum.history(every, 2) == [0, 1] and curriculum.skipped(every, 2, ["a", "b", "c"]) == []
    assert curriculum.inputs(cfg, 2)["window"] == 1 and "window" not in curriculum.inputs(every, 2)
