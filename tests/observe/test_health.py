"""Run health: the `health` view, `status`, the report and `run`'s warning line, over runs whose
train metrics (real metrics.parquet files under complete train manifests) cross each threshold
of rlhf_batch/sql/health.sql, and one run that crosses none. Every expected figure is worked
out by hand from the step values written below."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet
import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.observe import health as run_health
from rlhf_batch.observe import query as run_query
from rlhf_batch.observe.report import write_report
from rlhf_batch.store import atomic, layout, output
from rlhf_batch.store.schemas import METRICS

runner = CliRunner()
N = None  # a step that ran no token: its token means and ESS are null

# Four optimizer steps per iteration. A healthy iteration: clip [0, .1, .15, .3] has median
# (.1 + .15) / 2 = .125 <= .2; ESS [1, .9, .4, .8]: 1 of 4 steps below .5 = 25% <= 50%; entropy
# 4.0 each step; kl_approx at most .05 <= .1.
HEALTHY = {
    "clip_fraction": [0.0, 0.1, 0.15, 0.3],
    "ess": [1.0, 0.9, 0.4, 0.8],
    "entropy": [4.0, 4.0, 4.0, 4.0],
    "kl_approx": [0.0, 0.01, 0.05, 0.02],
}
CROSSING = {  # iteration -> (the steps that differ from HEALTHY, the one flag expected)
    1: ({"clip_fraction": [0.0, 0.25, 0.3, 0.35]}, "clip_fraction"),  # median (.25 + .3) / 2 = .275 > .2
    2: ({"ess": [1.0, 0.45, 0.3, 0.49]}, "ess"),  # 3 of 4 steps below .5: 75% > 50%
    3: ({"entropy": [1.9, 1.9, 1.9, 1.9]}, "entropy_fall"),  # 1.9 / 4.0 - 1 = -52.5%: fell > 50%
    4: ({"kl_approx": [0.0, 0.02, 0.3, 0.01], "entropy": [1.9] * 4}, "kl_spike"),  # max .3 > .1
}


def write_metrics(root: Path, it: int, values: dict[str, list[Any]], config: dict | None = None) -> None:
    """iter=K/train/metrics.parquet under a complete train manifest, as the train stage leaves it."""
    train = output.claim(layout.folder(root, it, "train"), "train", config or {}, {})
    n = len(values["ess"])
    cols: dict[str, list[Any]] = {name: [0.0] * n for name in METRICS.names}
    cols.update(step=list(range(n)), epoch=[0] * n, tokens=[10] * n, sequences=[2] * n, **values)
    atomic.write_parquet_atomic(train.sdir / layout.METRICS_FILE, pa.table(cols), METRICS)
    train.finish(0, {"rows": n})  # the train stage's manifest: rows = its optimizer steps


@pytest.fixture(scope="module")
def crossing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Iteration 0 healthy, then iterations 1-4 crossing one threshold each (CROSSING)."""
    root = tmp_path_factory.mktemp("health") / "crossing"
    write_metrics(root, 0, HEALTHY)
    for it, (changed, _) in CROSSING.items():
        write_metrics(root, it, {**HEALTHY, **changed})
    return root


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three iterations that cross nothing, close to each threshold without passing it: a
    median clip of exactly .2, ESS low on exactly half the steps, an entropy falling exactly
    50% (4.0 -> 2.0), a step with kl_approx exactly .1, and a step that ran no token."""
    root = tmp_path_factory.mktemp("health") / "healthy"
    write_metrics(root, 0, HEALTHY)
    write_metrics(root, 1, {**HEALTHY, "clip_fraction": [0.0, 0.2, 0.2, 0.3], "ess": [1.0, 0.4, 0.3, 0.9]})
    last = {"entropy": [2.0, 2.0, 2.0, N], "ess": [1.0, 0.9, 0.8, N], "kl_approx": [0.0, 0.1, 0.05, N]}
    write_metrics(root, 2, {**HEALTHY, **last, "clip_fraction": [0.0, 0.1, 0.1, N]})
    return root


def view(root: Path) -> list[dict[str, Any]]:
    con = run_query.connect(root)
    try:
        return run_health.rows(con)
    finally:
        con.close()


def test_each_threshold_flags_its_iteration_alone(crossing: Path) -> None:
    rows = {r["iter"]: r for r in view(crossing)}
    assert [rows[it]["flags"] for it in range(5)] == [[], *([flag] for _, flag in CROSSING.values())]
    assert rows[0]["warning"] == ""
    assert rows[1]["clip_fraction"] == pytest.approx(0.275)
    assert rows[1]["warning"] == "median clip_fraction 0.28 > 0.20"  # .275 printed with 2 decimals
    assert rows[2]["low_ess_share"] == 0.75
    assert rows[2]["warning"] == "ESS < 0.5 on 75% of steps (> 50%)"
    assert rows[3]["entropy_change"] == pytest.approx(-0.525)
    assert rows[3]["warning"] == "entropy fell 52% (> 50%) to 1.9"  # printf rounds 52.5 half to even
    assert rows[4]["entropy_change"] == pytest.approx(0.0)  # 1.9 after 1.9
    assert rows[4]["kl_approx_max"] == pytest.approx(0.3)
    assert rows[4]["warning"] == "kl_approx spiked to 0.3 (> 0.1)"


def test_a_run_at_the_thresholds_crosses_none(healthy: Path) -> None:
    rows = view(healthy)
    assert [r["flags"] for r in rows] == [[], [], []]
    assert [r["warning"] for r in rows] == ["", "", ""]
    assert rows[1]["clip_fraction"] == pytest.approx(0.2)  # median of [0, .2, .2, .3]
    assert rows[1]["low_ess_share"] == 0.5  # .4 and .3 of 4 steps
    assert rows[2]["entropy_change"] == pytest.approx(-0.5)  # 2.0 / 4.0 - 1, the null step left out
    assert rows[2]["low_ess_share"] == 0.0  # 3 steps with an ESS, none below .5
    assert rows[2]["kl_approx_max"] == pytest.approx(0.1)
    assert [run_health.iteration_warning(healthy, it) for it in range(3)] == [None, None, None]


def test_sql_has_the_health_view(crossing: Path) -> None:
    q = "SELECT iter, flags FROM health WHERE len(flags) > 0 ORDER BY iter"
    r = runner.invoke(app, ["sql", "--run-dir", str(crossing), "--format", "json", q])
    assert r.exit_code == 0, r.output
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert got == [{"iter": it, "flags": [flag]} for it, (_, flag) in CROSSING.items()]


def test_iteration_warning_reads_the_previous_trained_iteration(crossing: Path, tmp_path: Path) -> None:
    assert run_health.iteration_warning(crossing, 0) is None
    assert run_health.iteration_warning(crossing, 3) == "entropy fell 52% (> 50%) to 1.9"
    assert run_health.iteration_warning(crossing, 5) is None  # not trained
    # a gap: iteration 1 trained no step (empty metrics), so 2's entropy is compared with 0's
    root = tmp_path / "gap"
    write_metrics(root, 0, HEALTHY)
    write_metrics(root, 1, {k: [] for k in HEALTHY})
    write_metrics(root, 2, {**HEALTHY, "entropy": [1.0] * 4})  # 1.0 / 4.0 - 1 = -75%
    assert run_health.iteration_warning(root, 2) == "entropy fell 75% (> 50%) to 1"
    assert run_health.iteration_warning(root, 1) is None


def test_status_flags_each_crossing_iteration(crossing: Path, healthy: Path) -> None:
    r = runner.invoke(app, ["status", "--run-dir", str(crossing)])
    assert r.exit_code == 0, r.output
    train = [line for line in r.stdout.splitlines() if " train " in line]
    assert len(train) == 5
    assert "health ok" in train[0] and "HEALTH" not in train[0]
    for line, it in zip(train[1:], CROSSING, strict=True):
        assert f"HEALTH: {run_health.iteration_warning(crossing, it)}" in line
    r = runner.invoke(app, ["status", "--run-dir", str(healthy)])
    assert r.stdout.count("health ok") == 3 and "HEALTH" not in r.stdout


def test_report_lists_the_flagged_iterations(crossing: Path, healthy: Path, tmp_path: Path) -> None:
    page = write_report(crossing, tmp_path / "crossing").read_text()
    for it, (_, flag) in CROSSING.items():
        assert f"<td>{it}</td><td>{flag}</td>" in page
    summary = json.loads((tmp_path / "crossing" / "summary.json").read_text())
    assert [r.get("health") for r in summary] == [[], *([flag] for _, flag in CROSSING.values())]
    page = write_report(healthy, tmp_path / "healthy").read_text()
    assert "no iteration crossed a threshold" in page


def test_warning_line_names_the_iteration_and_the_view() -> None:
    line = run_health.warning_line(7, "median clip_fraction 0.41 > 0.20")
    assert line.startswith("warning: iteration 7 train health: median clip_fraction 0.41 > 0.20")
    assert "SELECT * FROM health" in line and "\n" not in line


def test_entropy_change_is_null_without_an_earlier_iteration(crossing: Path) -> None:
    first = view(crossing)[0]
    assert first["entropy_change"] is None and first["entropy"] == 4.0
    assert not math.isnan(first["clip_fraction"])


@pytest.mark.parametrize("lr, lines", [(0.05, 1), (1e-7, 0)])
def test_run_prints_one_warning_line_for_a_flagged_iteration(make_config, lr: float, lines: int) -> None:
    """A real one-iteration run: at lr 0.05 (AdamW steps of ~0.05 per weight on a tiny model) the
    policy moves far past the clip within the iteration (median clip fraction > 0.2); at 1e-7 it
    does not move (ratio 1: clip 0, ESS 1, KL 0) and nothing is printed. The flagged run also has
    a second reward part, token_reward (sum of the prompt ids + 1000 x response tokens), that
    dwarfs length_reward (response characters, at most 6 here): it explains nearly all of
    reward_raw's variance, so reward_health flags dominant_part and `run` prints that line too."""
    functions = ["tests.stages.test_score:length_reward"]
    if lines:
        functions.append("tests.stages.test_score:token_reward")
    extra = f"""
[score]
reward_functions = {json.dumps(functions)}
[train]
lr = {lr}
ppo_epochs = 2
sequences_per_step = 8
"""
    path, cfg = make_config(extra, in_process=True)
    r = runner.invoke(app, ["run", str(path), "--iterations", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if "train health" in line]
    assert len(warned) == lines, r.stderr
    flagged = [x for x in view(Path(cfg.run_dir)) if x["flags"]]
    assert len(flagged) == lines
    rewarded = [line for line in r.stderr.splitlines() if "reward health" in line]
    assert len(rewarded) == lines, r.stderr
    if lines:
        assert warned[0] == run_health.warning_line(0, flagged[0]["warning"])
        assert "clip_fraction" in flagged[0]["flags"]
        # the squared correlation of token_reward with reward_raw, from the scores file
        scores = pa.parquet.read_table(layout.folder(cfg.run_dir, 0, "scores")).to_pydict()
        x, y = scores["reward_token_reward"], scores["reward_raw"]
        r2 = _corr(x, y) ** 2
        assert r2 > 0.9
        assert rewarded[0] == run_health.reward_warning_line(
            0, f"reward_token_reward explains {100 * r2:.0f}% of reward_raw's variance (> 90%)"
        )
        r = runner.invoke(app, ["status", "--run-dir", cfg.run_dir])
        line = next(x for x in r.stdout.splitlines() if " scores " in x)
        assert "REWARD HEALTH: reward_token_reward explains" in line


def _corr(x: list[float], y: list[float]) -> float:
    """Pearson's correlation, written out."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy)


def test_gspo_clip_fraction_is_not_held_to_the_token_threshold(tmp_path: Path) -> None:
    """Under train.ratio_level = 'sequence' (GSPO) the clip binds for whole rows at GSPO's own
    range (3e-4 / 4e-4), so a median clip fraction of .275 (CROSSING[1]: (.25 + .3) / 2) is no
    sign of a bad update there; the same steps under token-level PPO are flagged."""
    root = tmp_path / "gspo"
    clipped = {**HEALTHY, "clip_fraction": [0.0, 0.25, 0.3, 0.35]}
    write_metrics(root, 0, clipped, {"train": {"ratio_level": "sequence"}})
    write_metrics(root, 1, clipped, {"train": {"ratio_level": "token"}})
    write_metrics(root, 2, clipped)  # a key at its default is not in the manifest: token
    rows = {r["iter"]: r for r in view(root)}
    assert [rows[it]["flags"] for it in range(3)] == [[], ["clip_fraction"], ["clip_fraction"]]
    assert rows[0]["clip_fraction"] == pytest.approx(0.275)  # still shown, only not judged
    assert run_health.iteration_warning(root, 0) is None
    assert run_health.iteration_warning(root, 1) == "median clip_fraction 0.28 > 0.20"


@pytest.mark.slow
def test_run_reward_check_reads_its_iteration_and_baseline_alone(make_config, monkeypatch) -> None:
    """Eight scored iterations (length_reward): 0-3 with write_rollouts' responses, 4-7 with longer
    ones ("{l}{l}{l}{l}", ...: every length + 2). By hand, per 3 prompts: lengths 2, 2, 3, 2 -> 4, 4,
    5, 4: mean 2.25 -> 4.25, pooled mean 3.25, mean square (21 + 73) / 8 = 11.75, sd sqrt(11.75 -
    10.5625) = 1.0897, z = 2 / 1.0897 = 1.84 for the score and the length in tokens (+ 2 each too):
    length_drift at 4, 5 and 6 (against 1, 2, 3); 7 against 4 rose nothing. The check `run` makes after each iteration's train reads the
    files of that iteration and of it - 3 alone (as many files at iteration 7 as at 4), and says
    what the whole-run reward_health view says of that iteration."""
    from rlhf_batch.stages.registry import run_stage
    from tests.stages.test_score import HERE, write_rollouts

    _, cfg = make_config(score={"reward_functions": [f"{HERE}:length_reward"]})
    longer = ("{l}{l}{l}{l}", "x{l}{l}{l}", "{l}{l}{l}{l}{l}", "zzzz")
    for it in range(8):
        if it < 4:
            write_rollouts(cfg, it)
        else:
            write_rollouts(cfg, it, responses=longer)
        run_stage("score", cfg, it, quiet=True)
    read: list[str] = []
    listed = run_query.listed

    def spy(root: Path, pattern: str) -> list[str]:
        files = listed(root, pattern)
        read.extend(files)
        return files

    monkeypatch.setattr(run_query, "listed", spy)
    con = run_query.connect(cfg.run_dir)
    whole = run_health.reward_warnings(con)
    con.close()
    assert sorted(whole) == [4, 5, 6] and all("length rose 1.84 sd" in w for w in whole.values()), whole
    counts = []
    for it in range(8):
        read.clear()
        assert run_query.iteration_reward_warning(cfg.run_dir, it) == whole.get(it)
        iters = sorted({int(Path(f).parts[-3].removeprefix("iter=")) for f in read})
        assert iters == ([it - 3, it] if it >= 3 else [it])
        counts.append(len(read))
    assert counts[3:] == [counts[3]] * 5  # 2 iterations x (rollouts + scores parts) each
