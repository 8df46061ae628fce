"""generate.prompts = [{path, weight}, ...]: seeded per-batch quotas of each source, recorded
in prompt_batch, a `source` column in the rollouts and the source_stats view. Real in-process
runs of the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.commands.pipeline import run_pipeline
from rlhf_batch.config import load_config
from rlhf_batch.core.mixtures import quotas, source_order
from rlhf_batch.errors import ConfigError
from rlhf_batch.runtime import faults
from rlhf_batch.store import layout, manifests

runner = CliRunner()
G, B = 4, 4  # weights 2:1 of 4 prompts: shares 8/3 and 4/3, so one prompt a batch goes by draw


def split(demo_prompts: Path, where: Path) -> tuple[Path, Path, list[str], list[str]]:
    lines = demo_prompts.read_text().splitlines()
    a, b = where / "a.jsonl", where / "b.jsonl"
    a.write_text("\n".join(lines[:8]) + "\n")
    b.write_text("\n".join(lines[8:]) + "\n")
    ids = [json.loads(x)["id"] for x in lines]
    return a, b, ids[:8], ids[8:]


def configure(make_config, tmp_path: Path, name: str, iterations: int) -> tuple[Path, Any]:
    sources = [{"path": "a.jsonl", "weight": 2.0, "name": "easy"}, {"path": "b.jsonl", "weight": 1}]
    return make_config(
        name=f"{name}.toml",
        run_dir=str(tmp_path / name),
        iterations=iterations,
        in_process=True,
        generate={"prompts": sources, "prompts_per_iteration": B, "prompts_per_part": 2},
        train={"lr": 1e-3},
    )


@pytest.mark.slow
def test_each_batch_takes_its_seeded_quota_of_every_source(make_config, demo_prompts, tmp_path) -> None:
    _, _, ids_a, ids_b = split(demo_prompts, tmp_path)
    path, cfg = configure(make_config, tmp_path, "mix", 2)
    assert cfg.generate.prompts[0]["path"] == str(tmp_path / "a.jsonl")  # relative to the config file
    run_pipeline(path, [], quiet=True)
    for it in (0, 1):
        rows = pq.read_table(layout.folder(cfg.run_dir, it, "rollouts")).to_pylist()
        pb = manifests.manifest(layout.folder(cfg.run_dir, it, "rollouts"))["prompt_batch"]
        q = quotas(it, [2.0, 1.0], B, cfg.seed)
        assert [pb["sources"][n]["quota"] for n in ("easy", "b")] == q and sum(q) == B
        assert sorted(q) == [1, 3] or q == [2, 2]  # floors 2 and 1, plus one by draw
        # each source's prompts: positions [start, stop) of its own epoch-0 order (8 and 4 fit twice)
        want = []
        for i, (name, ids) in enumerate([("easy", ids_a), ("b", ids_b)]):
            s = pb["sources"][name]
            assert s["epoch"] == 0 and s["prompts_in_source"] == len(ids)
            want += [
                ids[r] for r in source_order(len(ids), cfg.seed, i, 0)[s["positions"][0] : s["positions"][1]]
            ]
            assert s["positions"][0] == (0 if it == 0 else quotas(0, [2.0, 1.0], B, cfg.seed)[i])
        assert list(dict.fromkeys(r["prompt_id"] for r in rows)) == want
        # the source column: each prompt's source, G rollouts each
        by_source = Counter(r["source"] for r in rows)
        assert by_source == {"easy": q[0] * G, "b": q[1] * G}
        assert all((r["prompt_id"] in ids_a) == (r["source"] == "easy") for r in rows)

    res = runner.invoke(
        app, ["sql", "--run-dir", cfg.run_dir, "SELECT * FROM source_stats ORDER BY ALL", "-f", "json"]
    )
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    want_rows = []
    for it in (0, 1):
        roll = pq.read_table(layout.folder(cfg.run_dir, it, "rollouts")).to_pylist()
        score = {
            r["rollout_id"]: r for r in pq.read_table(layout.folder(cfg.run_dir, it, "scores")).to_pylist()
        }
        for name in sorted({r["source"] for r in roll}):
            mine = [r for r in roll if r["source"] == name]
            s = [score[r["rollout_id"]]["score"] for r in mine]
            w = [score[r["rollout_id"]]["reward"] for r in mine]
            want_rows.append(
                {
                    "iter": it,
                    "source": name,
                    "prompts": len({r["prompt_id"] for r in mine}),
                    "rollouts": len(mine),
                    "mean_score": pytest.approx(sum(s) / len(s)),
                    "mean_reward": pytest.approx(sum(w) / len(w)),
                    "pass_rate": pytest.approx(sum(x > 0.5 for x in s) / len(s)),
                }
            )
    assert got == want_rows


def test_mixture_settings_are_checked_in_one_line(make_config, demo_prompts, tmp_path) -> None:
    split(demo_prompts, tmp_path)
    path, _ = configure(make_config, tmp_path, "bad", 1)
    for override, words in [
        ("generate.prompts_per_iteration=0", "prompts_per_iteration >= 1"),
        ('generate.prompts=[{path="a.jsonl", weight=-1}]', "'weight' must be a number > 0"),
        ('generate.prompts=[{path="a.jsonl", weight=1}, "b.jsonl"]', "generate.prompts"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(path, [override])
        assert words in str(e.value) and "\n" not in str(e.value)
    # a source too small for its quota: generate refuses, naming the prompts key
    # weights 2:1 of 13 prompts: source 0's share 26/3 rounds up to 9 > its 8 prompts
    small = load_config(path, ["generate.prompts_per_iteration=13"])
    from rlhf_batch.errors import StageError
    from rlhf_batch.stages.registry import run_stage

    with pytest.raises(StageError) as e:
        run_stage("generate", small, 0, quiet=True)
    assert "generate.prompts: source 0 has 8 prompts, fewer than its quota of up to 9 per batch" in str(
        e.value
    )


@pytest.mark.slow
def test_a_killed_mixture_generate_resumes_to_the_same_rollouts(make_config, demo_prompts, tmp_path) -> None:
    split(demo_prompts, tmp_path)
    ref_path, ref = configure(make_config, tmp_path, "ref", 2)
    run_pipeline(ref_path, [], quiet=True)
    path, cfg = configure(make_config, tmp_path, "killed", 1)
    run_pipeline(path, [], quiet=True)
    env = {
        **os.environ,
        faults.FAULT_ENV: "rollouts:part-0:done",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    cmd = [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--iter", "1", "--quiet"]
    killed = subprocess.run(
        [*cmd, "--set", "iterations=2"], env=env, capture_output=True, text=True, timeout=600
    )
    assert killed.returncode == -9, killed.stderr
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "rollouts")) is None
    run_pipeline(path, ["iterations=2"], quiet=True)
    for folder in ("rollouts", "scores", "advantages"):
        a, b = (pq.read_table(layout.folder(d, 1, folder)) for d in (cfg.run_dir, ref.run_dir))
        drop = ["policy"] if folder == "rollouts" else []
        assert a.drop_columns(drop).equals(b.drop_columns(drop)), folder
    pa_, pb = (
        manifests.manifest(layout.folder(d, 1, "rollouts"))["prompt_batch"]
        for d in (cfg.run_dir, ref.run_dir)
    )
    assert pa_ == pb
    res = runner.invoke(app, ["status", "--run-dir", cfg.run_dir])
    assert res.exit_code == 0, res.output
