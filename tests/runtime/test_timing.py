"""Where an iteration's time goes: every stage's manifest records start-up and work seconds,
tokens and tokens/s (the executor's clock, timing.py); `status`, the `stages` view and the
report show them. Real stage processes on the tiny model; tokens counted again with pyarrow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.observe.report import write_report
from rlhf_batch.stages.importer import import_rollouts
from rlhf_batch.store import layout, manifests

runner = CliRunner()
STAGES = ("generate", "score", "advantage", "train", "eval")
FOLDER = {
    "generate": "rollouts",
    "score": "scores",
    "advantage": "advantages",
    "train": "train",
    "eval": "eval",
}
EPOCHS = 2


def lengths(table, *columns: str) -> int:
    """Tokens of list columns, counted here with pyarrow (not with the stages' helper)."""
    return sum(sum(len(v) for v in table[c].to_pylist()) for c in columns)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_prompts: Path) -> tuple[Path, dict]:
    """One iteration, each stage a `python -m rlhf_batch STAGE` process timed from outside."""
    import tomli_w

    tmp = tmp_path_factory.mktemp("timing")
    config = tmp / "config.toml"
    raw = {
        "run_dir": str(tmp / "run"),
        "policy_model": str(tiny_model),
        "device": "cpu",
        "dtype": "float32",
        "threads": 1,
        "generate": {
            "prompts": str(demo_prompts),
            "num_generations": 4,
            "max_new_tokens": 6,
            "prompts_per_part": 5,
        },
        "score": {"reward_functions": ["rlhf_batch.rewards.demo:letter_count"], "rows_per_part": 20},
        "advantage": {"drop_zero_variance": False},
        "train": {"ppo_epochs": EPOCHS},
        "eval": {"prompts": str(demo_prompts), "n": 2},
    }
    config.write_text(tomli_w.dumps(raw))
    walls = {}
    for stage in STAGES:
        cmd = [sys.executable, "-P", "-m", "rlhf_batch", stage, str(config), "--iter", "0", "--quiet"]
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        walls[stage] = time.monotonic() - t0
        assert res.returncode == 0, res.stderr
    return Path(raw["run_dir"]), walls


def timing(root: Path, folder: str, it: int = 0) -> dict:
    m = manifests.manifest(layout.folder(root, it, folder))
    assert m is not None
    return m["timing"]


@pytest.mark.slow
def test_every_stage_records_startup_and_work_within_its_wall_time(run) -> None:
    root, walls = run
    for stage in STAGES:
        t = timing(root, FOLDER[stage])
        assert t["startup_s"] > 0 and t["work_s"] > 0, (stage, t)
        # from the process start (imports included) to the manifest: inside the time measured
        # around the process, which also holds its fork/exec and exit
        assert t["startup_s"] + t["work_s"] <= walls[stage], (stage, t, walls[stage])
        # a stage process imports torch and loads a model or DuckDB before its first part
        assert t["startup_s"] > 0.2, (stage, t)
        # tokens/s is tokens / work over the unrounded work time; work_s is rounded to 4 decimals
        # (+-0.00005 s) and tokens/s to 1 (+-0.05): the recorded figure lies between the bounds
        lo = t["tokens"] / (t["work_s"] + 0.00005) - 0.05
        hi = t["tokens"] / max(t["work_s"] - 0.00005, 1e-9) + 0.05
        assert lo <= t["tokens_per_s"] <= hi, (stage, t)


def test_tokens_are_the_lengths_in_the_stage_output(run) -> None:
    root, _ = run
    rollouts = pq.read_table(root / "iter=0000/rollouts")
    advantages = pq.read_table(root / "iter=0000/advantages")
    evals = pq.read_table(root / "iter=0000/eval")
    # generate and eval: prompt + response tokens of the rows they wrote
    assert timing(root, "rollouts")["tokens"] == lengths(rollouts, "prompt_ids", "response_ids") > 0
    assert timing(root, "eval")["tokens"] == lengths(evals, "prompt_ids", "response_ids") > 0
    # score: prompt + response tokens of every rollout it scored (all of them)
    assert pq.read_table(root / "iter=0000/scores").num_rows == rollouts.num_rows
    assert timing(root, "scores")["tokens"] == lengths(rollouts, "prompt_ids", "response_ids")
    # advantage: the input_ids it wrote; train: each of the EPOCHS passes over the rows it runs,
    # those of advantage != 0 (no KL or entropy term here: a row of advantage 0 runs no pass)
    assert timing(root, "advantages")["tokens"] == lengths(advantages, "input_ids") > 0
    moving = advantages.filter(pc.not_equal(advantages["advantage"], 0.0))
    assert 0 < moving.num_rows < advantages.num_rows  # drop_zero_variance = false kept some 0s
    assert timing(root, "train")["tokens"] == EPOCHS * lengths(moving, "input_ids")


def test_import_in_process_counts_from_the_call(make_config, tmp_path: Path) -> None:
    """In-process (no stage command) start-up counts from the call of execute, so start-up +
    work fit in the time measured around that call."""
    _, cfg = make_config()
    rows = [{"prompt": "a*2=", "response": "aa"}, {"prompt": "b*3=", "response": "bbxb"}]
    src = tmp_path / "ext.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.monotonic()
    import_rollouts(cfg, src, 0, quiet=True)
    wall = time.monotonic() - t0
    t = timing(Path(cfg.run_dir), "rollouts")
    assert t["startup_s"] > 0 and t["work_s"] > 0 and t["startup_s"] + t["work_s"] <= wall
    out = pq.read_table(Path(cfg.run_dir) / "iter=0000/rollouts")
    # char-level tokenizer: prompts 4 + 4 characters, responses 2 + 4 plus an EOS each = 16
    assert t["tokens"] == lengths(out, "prompt_ids", "response_ids") == 16


def test_process_start_is_the_interpreter_start(tmp_path: Path) -> None:
    """A process that sleeps 0.5 s before importing rlhf_batch still counts from its start."""
    code = (
        "import time; time.sleep(0.5); from rlhf_batch.runtime.timing import process_start; "
        "print(time.monotonic() - process_start())"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.monotonic() - t0
    age = float(out.stdout)
    # the kernel's start time is whole clock ticks, rounded down: the age may exceed the wall
    # time measured around the child by up to one tick
    assert 0.5 <= age <= wall + 1 / os.sysconf("SC_CLK_TCK")


def status_rows(root: Path) -> dict[tuple[str, str], list[str]]:
    res = runner.invoke(app, ["status", "--run-dir", str(root)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[1].split()[2:7] == ["state", "rows", "startup_s", "work_s", "tok/s"]
    return {tuple(line.split()[:2]): line.split()[2:7] for line in lines[2:]}


def test_status_sql_and_report_show_the_timing(run, tmp_path: Path) -> None:
    root, _ = run
    rows = status_rows(root)
    for folder in FOLDER.values():
        t = timing(root, folder)
        assert rows["0", folder] == [
            "complete",
            rows["0", folder][1],
            f"{t['startup_s']:.1f}",
            f"{t['work_s']:.1f}",
            f"{t['tokens_per_s']:.0f}",
        ]
    res = runner.invoke(
        app,
        ["sql", "--run-dir", str(root), "-f", "json",
         "SELECT stage, startup_s, work_s, tokens, tokens_per_s FROM stages WHERE iter = 0"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    got = {r.pop("stage"): r for r in map(json.loads, res.stdout.splitlines())}
    assert got == {folder: timing(root, folder) for folder in FOLDER.values()}
    page = write_report(root, tmp_path / "report")
    png = tmp_path / "report/time.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 'src="time.png"' in page.read_text()
    summary = json.loads((tmp_path / "report/summary.json").read_text())
    assert summary[0]["time"]["train"] == {k: timing(root, "train")[k] for k in ("startup_s", "work_s")}


def test_manifests_without_timing_still_read(run, tmp_path: Path) -> None:
    """A run written before stages recorded their time: null columns, '-' in status, no plot."""
    import shutil

    root = tmp_path / "old"
    shutil.copytree(run[0], root, ignore=shutil.ignore_patterns("report"))
    for folder in FOLDER.values():
        path = layout.folder(root, 0, folder) / layout.MANIFEST
        m = json.loads(path.read_text())
        del m["timing"]
        path.write_text(json.dumps(m))
    assert all(r[2:] == ["-", "-", "-"] for r in status_rows(root).values())
    res = runner.invoke(
        app, ["sql", "--run-dir", str(root), "-f", "csv", "SELECT count(*) AS n, count(startup_s) AS t, "
              "count(work_s) + count(tokens) + count(tokens_per_s) AS rest FROM stages"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == ["n,t,rest", "5,0,0"]
    write_report(root, tmp_path / "report")
    assert (tmp_path / "report/reward.png").exists() and not (tmp_path / "report/time.png").exists()


def test_report_adds_top_up_rounds_to_their_stage(run, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "topped"
    shutil.copytree(run[0], root, ignore=shutil.ignore_patterns("report"))
    round_dir = layout.folder(root, 0, "scores", topup=1)
    round_dir.mkdir(parents=True)
    (round_dir / layout.MANIFEST).write_text(json.dumps({"timing": {"startup_s": 1.5, "work_s": 0.25}}))
    write_report(root, tmp_path / "report")
    summary = json.loads((tmp_path / "report/summary.json").read_text())
    t = timing(root, "scores")
    assert summary[0]["time"]["scores"] == pytest.approx(
        {"startup_s": t["startup_s"] + 1.5, "work_s": t["work_s"] + 0.25}
    )
