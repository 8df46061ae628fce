"""Every benchmark runs on the tiny model and workload, so that none of them rots.

The figures of a tiny run mean nothing; what is checked is that each benchmark finishes and
appends its rows (date, machine, workload, ours, baseline, ratio, memory, target) to the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
ROWS = {  # benchmark script -> the rows it must append
    "bench_startup.py": ["cli --help", "stage start-up"],
    "bench_score.py": ["score tokens/s", "score MFU", "score scaling", "score memory @ vocab 128k"],
    "bench_generate.py": [
        "generate tokens/s",
        "generate decode vs its limit, float32",  # bf16 too where the CPU has bf16 units
        "generate decode loop, static vs dynamic path, float32",
        "generate tokens/s, vllm engine",
        "generate start-up, vllm engine",
    ],
    "bench_advantage.py": [
        "advantage vs MCAdvantage",
        "advantage group statistics",
        "advantage stage peak memory",
    ],
    "bench_store.py": ["advantage on an object store"],  # needs the moto server (make s3)
    "bench_train.py": [
        "train tokens/s",
        "train MFU",
        "train padding",
        "train LoRA tokens/s",
        "train LoRA trainable parameters",
    ],
    "bench_fixed_costs.py": [
        "stage-process model load",
        "in-process reload",
        "in-process optimizer reload",
        "optimizer state save",
        "demo in-process",
        "demo bytes written per iteration",
    ],
    # TRL's side runs only where .venv-trl exists (make trl); make test does not install it
    "bench_learning.py": ["learning: mean score by iteration", "learning: best score", "learning: wall time"],
    "bench_distill.py": ["on-policy distillation vs GRPO"],
    "bench_long_run.py": [
        "long run: overhead per iteration",
        "long run: status",
        "long run: sql aggregate",
        "long run: report",
        "long run: run directory per iteration",
    ],
    "bench_staleness.py": [
        "staleness: time to lock-step's final score",
        "staleness: final score",
        "staleness: wall time and idle lanes",
    ],
}


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "peaks.json"
    subprocess.run(
        [sys.executable, str(BENCH / "peak.py"), "--tiny", "--out", str(out)], check=True, cwd=ROOT
    )
    return out


def bench(script: str, args: list[str], results: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """benchmarks/SCRIPT ARGS appending to `results`, its model and workload cached in `cache`."""
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--results", str(results)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "RLHF_BATCH_BENCH_CACHE": str(cache)},
        timeout=300,
    )


@pytest.mark.parametrize("script", list(ROWS))
@pytest.mark.slow
def test_benchmark_runs_on_the_tiny_workload(script: str, peaks: Path, tmp_path: Path) -> None:
    results = tmp_path / "results.md"
    proc = bench(script, ["--tiny", "--peaks", str(peaks)], results, tmp_path.parent / "bench-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = results.read_text()
    assert table.count("| date | machine |") == 1  # one header, then the rows
    for name in ROWS[script]:
        row = next((line for line in table.splitlines() if f"| {name} |" in line), None)
        assert row is not None, f"{script} wrote no '{name}' row:\n{table}"
        assert len(row.split(" | ")) == 11, row  # every column filled (with '-' where it has no value)


@pytest.mark.slow
def test_learning_benchmark_with_two_seeds_and_an_override(tmp_path: Path) -> None:
    """--seeds: rows per seed, then rows of their mean; --set reaches ours and is named; the
    multi-turn task (--task ask, pipelines/ask.toml) adds its turn-2 rows."""
    results, cache = tmp_path / "results.md", tmp_path / "bench-cache"
    args = [
        "--tiny",
        "--no-trl",
        "--task",
        "ask",
        "--seeds",
        "0,1",
        "--set",
        "advantage.drop_zero_variance=false",
    ]
    proc = bench("bench_learning.py", args, results, cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in results.read_text().splitlines() if r.startswith("| 20")]
    benches = [r.split(" | ")[2] for r in rows]
    per_seed = [
        f"learning: {b} (multi-turn)"
        for b in (
            "mean score by iteration",
            "answer score (env_answer) by iteration",
            "answers starting with the letter by iteration",
            "best score",
            "wall time",
        )
    ]
    assert benches == per_seed * 2 + [f"{b}, mean over seeds" for b in per_seed]
    assert "seed 0)" in rows[0] and "seed 1)" in rows[5] and "seeds 0,1)" in rows[10]
    assert all("pipelines/ask.toml: max_turns 2" in rows[i] for i in (0, 5, 10))
    assert all("ours with advantage.drop_zero_variance=false" in rows[i] for i in (0, 5, 10))
    answers = [float(x) for x in rows[1].split(" | ")[5].split()]
    assert len(answers) == 2 and all(0.0 <= a <= 1.0 for a in answers)
    # a bad override is ours' config error, not a silent default
    bad = bench(
        "bench_learning.py", ["--tiny", "--no-trl", "--set", "advantage.nope=1"], tmp_path / "bad.md", cache
    )
    assert bad.returncode != 0 and "nope" in bad.stderr


@pytest.mark.slow
def test_learning_benchmark_of_the_calculator_task_runs_with_the_tool_and_without(tmp_path: Path) -> None:
    """--task calc: per seed, the calculator task with the built-in tool environment (ours
    column) and without tools (baseline column), from the same model: rows by iteration, the best
    answer score and the wall time, and the answer curves' plot."""
    results, png = tmp_path / "results.md", tmp_path / "calc.png"
    args = ["--tiny", "--task", "calc", "--seeds", "0", "--png", str(png)]
    proc = bench("bench_learning.py", args, results, tmp_path / "bench-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r.split(" | ") for r in results.read_text().splitlines() if r.startswith("| 20")]
    assert [r[2] for r in rows] == [
        f"learning: {b} (calculator)"
        for b in (
            "mean score by iteration",
            "answer score (digits of the product right) by iteration",
            "exact answers by iteration",
            "right calls (the prompt's expression) by iteration",
            "best answer score",
            "wall time",
        )
    ]
    assert "pipelines/calc.toml (built-in tool environment" in rows[0][3] and "seed 0" in rows[0][3]
    for r in rows[:4]:  # two iterations, with the tool and without
        values = [float(x) for x in (r[5] + " " + r[6]).split()]
        assert len(values) == 4 and all(0.0 <= v <= 1.0 for v in values), r
    assert png.stat().st_size > 0


def test_the_calculator_task_without_tools_has_the_same_budget() -> None:
    """pipelines/calc_no_tools.toml is pipelines/calc.toml without the environment, key by key."""
    from dataclasses import asdict

    from rlhf_batch.config import load_config

    same = ["run_dir=/runs/x"]  # the paths below the run directory then agree too
    tools, alone = (load_config(ROOT / "pipelines" / f, same) for f in ("calc.toml", "calc_no_tools.toml"))
    assert tools.generate.environment == "rlhf_batch.envs.tools:calculator_environment"
    assert alone.generate.environment == "" and tools.generate.max_turns == 2
    a, b = asdict(tools), asdict(alone)
    for cfg in (a, b):
        for key in ("environment", "max_turns", "tool_parser"):
            cfg["generate"].pop(key)
    assert a == b


def test_learning_worker_runs_iterations_as_run_does(tmp_path: Path) -> None:
    """Ours' loop in bench_learning is `run`'s (pipeline.run_iteration): top-up rounds included."""
    sys.path.insert(0, str(BENCH))
    import bench_learning

    from rlhf_batch.data.demo import write_prompts
    from rlhf_batch.models.tiny import init_model

    model, prompts = init_model(tmp_path / "model", seed=0), write_prompts(tmp_path / "p.jsonl", 64)
    spec = {
        **{"model": str(model), "prompts": str(prompts), "iterations": 2, "prompts_per_iteration": 16},
        **{"seed": 0, "threads": 1, "run_dir": str(tmp_path / "ours"), **bench_learning.end_tokens(model)},
        "set": [
            "advantage.min_groups=16",
            "advantage.max_topup_rounds=1",
        ],  # 16 groups: never all informative
    }
    out = bench_learning.worker_ours(spec)
    assert len(out["scores"]) == len(out["known_s"]) == 2
    rounds = sorted(
        p.relative_to(tmp_path / "ours").as_posix() for p in (tmp_path / "ours").glob("iter=*/topup=*")
    )
    assert rounds == ["iter=0000/topup=01", "iter=0001/topup=01"]


def test_learning_benchmark_shares_the_demo_settings() -> None:
    """The settings bench_learning gives TRL are the demo's (pipelines/demo.toml), key by key."""
    sys.path.insert(0, str(BENCH))
    import bench_learning

    from rlhf_batch.config import load_config

    cfg = load_config(bench_learning.DEMO, [])
    g, t = cfg.generate, cfg.train
    ours = {
        "num_generations": g.num_generations,
        "prompts_per_iteration": g.prompts_per_iteration,
        "max_new_tokens": g.max_new_tokens,
        "temperature": g.temperature,
        "lr": t.lr,
        "lr_schedule": t.lr_schedule,
        "total_steps": t.total_steps,
        "ppo_epochs": t.ppo_epochs,
        "eps": t.eps_low,
        "max_grad_norm": t.max_grad_norm,
        "sequences_per_step": t.sequences_per_step,
        "iterations": cfg.iterations,
    }
    assert ours == bench_learning.SHARED
    assert (t.eps_high, t.kl_loss_coef, cfg.score.kl_in_reward, t.warmup_steps) == (0.0, 0.0, False, 0)
    # TRL's max_steps (iterations x steps per generation x epochs) is the length of our schedule
    steps_per_generation = g.num_generations * g.prompts_per_iteration // t.sequences_per_step
    assert cfg.iterations * steps_per_generation * t.ppo_epochs == t.total_steps
