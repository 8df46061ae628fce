"""`rlhf-batch run`: the whole loop, skipping completed work; the report; the demo learns."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.commands.pipeline import reward_by_iteration
from rlhf_batch.observe.report import write_report
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_batch", "run", *args], capture_output=True, text=True)


def created(run_dir: str) -> dict[str, str]:
    return {str(p): p.read_text() for p in Path(run_dir).glob("iter=*/*/_manifest.json")}


@pytest.mark.slow
def test_run_in_subprocesses_then_again_does_nothing_and_more_iterations_extend(make_config) -> None:
    path, cfg = make_config(iterations=2, threads=1, train={"lr": 1e-3, "tokens_per_step": 256})
    first = run(str(path), "--quiet")
    assert first.returncode == 0, first.stderr
    for it in (0, 1):
        for stage in ("rollouts", "scores", "advantages", "train"):
            m = manifests.manifest(layout.folder(cfg.run_dir, it, stage))
            assert m is not None
            assert m["resolved_config"] == cfg.to_dict()  # the whole config, paths resolved, each stage
    assert "iter  mean score  mean reward" in first.stdout and "report: " in first.stdout
    before = created(cfg.run_dir)
    again = run(str(path), "--quiet")
    assert again.returncode == 0, again.stderr
    assert created(cfg.run_dir) == before  # nothing was redone
    more = run(str(path), "--quiet", "--iterations", "3", "--in-process")
    assert more.returncode == 0, more.stderr
    after = created(cfg.run_dir)
    assert {k: v for k, v in after.items() if k in before} == before
    assert len(after) == len(before) + 4  # iteration 2's four stages
    changed = run(str(path), "--quiet", "--set", "train.lr=0.5")
    assert changed.returncode == 1
    assert "complete with a different config" in changed.stderr and "--force" in changed.stderr


def test_report_on_a_partial_run(make_config, tmp_path: Path) -> None:

    _, cfg = make_config()
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)
    page = write_report(cfg.run_dir, tmp_path / "out", tensorboard=True)
    html = page.read_text()
    assert (tmp_path / "out" / "reward.png").stat().st_size > 1000
    assert (tmp_path / "out" / "length.png").exists() and not (tmp_path / "out" / "train.png").exists()
    assert "Best and worst responses (iteration 0)" in html and html.count("<tr><td>best</td>") == 5
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
    rows = reward_by_iteration(cfg)
    assert len(rows) == 1 and 0.0 <= rows[0]["score"] <= 1.0


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def spread(*, responses: list[str], **_: object) -> list[float]:
    """A reward for the report test that tells almost any two responses apart (the untrained
    model scores ~0 on the demo task): the sum of the code points mod 101, / 100."""
    return [sum(map(ord, r)) % 101 / 100 for r in responses]


def test_report_on_a_complete_run(make_config, tmp_path: Path) -> None:
    """Two in-process iterations; every plot, and the best / worst table of iteration 1 recomputed
    from its Parquet files: by score (descending), ties by rollout_id, five of each."""
    import html

    import pyarrow.parquet as pq

    from rlhf_batch.commands.pipeline import run_pipeline

    score = {"reward_functions": ["tests.commands.test_pipeline:spread"], "kl_in_reward": True}  # kl.png
    # no `threads`: in-process it would set torch's thread count for the rest of the pytest process
    path, cfg = make_config(iterations=2, in_process=True, train={"lr": 1e-2}, score=score)
    run_pipeline(path, [], quiet=True)
    page = write_report(cfg.run_dir, tmp_path / "out")
    sizes = {"train.png": (1260, 558)}  # 14 x 6.2 in at 90 dpi (2 rows of panels); the others 5 x 3.2 in
    for name in ("reward.png", "kl.png", "length.png", "filtered.png", "train.png"):
        data = (tmp_path / "out" / name).read_bytes()
        # PNG signature, IHDR width x height, and the IEND chunk last (not truncated); a figure
        # with axes but no data is ~10 kB, a blank or broken file far less
        assert data[:8] == PNG_MAGIC and data[-8:-4] == b"IEND" and len(data) > 5000, name
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert (width, height) == sizes.get(name, (450, 288)), name
        assert f'<img src="{name}"' in page.read_text()
    it1 = Path(cfg.run_dir) / "iter=0001"
    scores = {r["rollout_id"]: r["score"] for r in pq.read_table(it1 / "scores").to_pylist()}
    responses = {r["rollout_id"]: r["response"] for r in pq.read_table(it1 / "rollouts").to_pylist()}
    ranked = sorted((-s, rid) for rid, s in scores.items() if s is not None)  # best first
    assert len(ranked) == 48  # 12 prompts x 4, all scored: more than 5 + 5
    expected = [("best", rid) for _, rid in ranked[:5]] + [("worst", rid) for _, rid in ranked[::-1][:5]]
    text = page.read_bytes().decode()  # not read_text: responses may hold a \r
    assert "Best and worst responses (iteration 1)" in text
    table = text.split("Best and worst responses")[1]
    rows = re.findall(
        r"<tr><td>(best|worst)</td><td>([^<]*)</td><td><pre>.*?</pre></td><td><pre>(.*?)</pre>", table, re.S
    )
    assert [(k, float(s), html.unescape(r)) for k, s, r in rows] == [
        (k, pytest.approx(scores[rid], rel=1e-3), responses[rid]) for k, rid in expected
    ]


@pytest.mark.slow
def test_the_demo_learns_healthily_and_would_not_with_a_zero_learning_rate(tmp_path: Path) -> None:
    """The demo as `make demo` runs it: its mean score reaches 0.7 (measured on the AMD EPYC with
    AVX512-BF16: 0.83 at iteration 30, 0.92 at 39), the median clip fraction of its steps stays
    under 0.2, ESS is above 0.5 on most steps, and no iteration crosses a health threshold. With
    lr = 0 (16 iterations) the mean score stays at the random model's ~0.002-0.004 (its standard
    error over 512 rollouts is ~0.002)."""
    from rlhf_batch.observe import query

    run_dir = tmp_path / "demo"
    res = run(str(ROOT / "pipelines/demo.toml"), "--quiet", "--set", f"run_dir={run_dir}")
    assert res.returncode == 0, res.stderr
    scores = [float(line.split()[1]) for line in res.stdout.splitlines()[1:41]]
    assert len(scores) == 40 and max(scores) >= 0.7 and scores[-1] >= 0.7, scores
    assert "train health" not in res.stderr  # run's warning line
    con = query.connect(run_dir)
    try:
        clip, ess_ok = con.execute(
            "SELECT median(clip_fraction), avg((ess > 0.5)::INT) FROM metrics"
        ).fetchone()
        flagged = con.execute("SELECT count(*) FROM health WHERE len(flags) > 0").fetchone()[0]
    finally:
        con.close()
    assert clip < 0.2 and ess_ok > 0.5 and flagged == 0
    flat = tmp_path / "lr0"
    res = run(
        str(ROOT / "pipelines/demo.toml"),
        *("--quiet", "--iterations", "16", "--set", f"run_dir={flat}", "--set", "train.lr=0.0"),
    )
    assert res.returncode == 0, res.stderr
    flat_scores = [float(line.split()[1]) for line in res.stdout.splitlines()[1:17]]
    assert max(flat_scores) < 0.02  # the same test with a learning rate of 0 fails the assertions above


def test_run_cli_and_airflow_dag_use_the_registry_order() -> None:
    import ast

    from rlhf_batch.commands.cli import app
    from rlhf_batch.stages.registry import pipeline, stages

    names = [s.name for s in pipeline()]
    assert names == ["eval", "generate", "score", "advantage", "train"]
    dag = ast.parse((ROOT / "pipelines" / "airflow_dag.py").read_text())
    (value,) = [n.value for n in dag.body if isinstance(n, ast.Assign) and n.targets[0].id == "STAGES"]  # type: ignore[attr-defined]
    assert list(ast.literal_eval(value)) == names  # the DAG runs in Airflow's own venv: a copy, checked
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}  # type: ignore[union-attr]
    assert {s.name for s in stages()} <= commands


@pytest.mark.slow
def test_prompt_batches_are_the_same_whether_a_run_is_extended_or_sized_by_epochs(
    make_config, tmp_path: Path
) -> None:
    # 12 prompts, 5 per iteration: 2 iterations per epoch. A run of 1 iteration extended to 3 and a
    # run sized as 2 epochs (4 iterations) sample the same prompts at iterations 0..2.
    extra = "[generate]\nprompts_per_iteration = 5\n[train]\nlr = 1e-3\ntokens_per_step = 256"
    path, cfg = make_config(extra, iterations=1, threads=1, in_process=True)
    assert run(str(path), "--quiet").returncode == 0
    more = run(str(path), "--quiet", "--iterations", "3")
    assert more.returncode == 0, more.stderr
    epath, ecfg = make_config(
        extra, epochs=2, threads=1, in_process=True, run_dir=str(tmp_path / "e"), name="e.toml"
    )
    by_epochs = run(str(epath), "--quiet")
    assert by_epochs.returncode == 0, by_epochs.stderr

    def batches(c, n: int) -> list[dict]:
        return [
            manifests.manifest(layout.folder(c.run_dir, it, "rollouts"))["prompt_batch"] for it in range(n)
        ]

    assert manifests.manifest(layout.folder(ecfg.run_dir, 3, "train")) is not None  # 2 epochs x 2 iterations
    assert batches(cfg, 3) == batches(ecfg, 3)
    assert [(b["epoch"], b["positions"]) for b in batches(ecfg, 4)] == [
        (0, [0, 5]),
        (0, [5, 10]),
        (1, [0, 5]),
        (1, [5, 10]),
    ]


SETTLE = """
import gc, sys
from pathlib import Path
from rlhf_batch.commands.pipeline import run_pipeline
before = gc.get_threshold()
run_pipeline(Path(sys.argv[1]), [], quiet=True, settle_heap=sys.argv[2] == "1")
print("heap", gc.get_freeze_count(), gc.get_threshold() == before)
"""


@pytest.mark.slow
def test_an_in_process_run_settles_its_heap_after_the_first_iteration_and_exits_clean(make_config) -> None:
    # the `run` command (settle_heap) in one process: after iteration 0 the objects the process
    # holds are frozen (left out of later full collections) and the collector's thresholds are
    # back; at exit they are unfrozen, so that finalisation frees them (DuckDB's bindings report
    # every object of theirs still alive then: seen when frozen objects stayed frozen). Without
    # settle_heap (the Python API's default) nothing is frozen.
    path, _ = make_config(iterations=2, in_process=True, threads=1)
    settled = subprocess.run([sys.executable, "-c", SETTLE, str(path), "1"], capture_output=True, text=True)
    assert settled.returncode == 0, settled.stderr
    frozen, restored = settled.stdout.split("heap ")[-1].split()
    assert int(frozen) > 100_000 and restored == "True"  # torch and transformers' objects among them
    assert "leaked" not in settled.stderr
    path, _ = make_config(iterations=1, in_process=True, threads=1, run_dir=str(Path(path).parent / "api"))
    plain = subprocess.run([sys.executable, "-c", SETTLE, str(path), "0"], capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split("heap ")[-1].split() == ["0", "True"]


@pytest.mark.slow
def test_run_with_eval_on_the_demo_config_builds_the_demo_first(tmp_path: Path) -> None:
    """Eval of iteration 0 runs before generate: it builds the demo model and prompts too."""
    from rlhf_batch.commands.pipeline import run_pipeline

    demo = Path(__file__).resolve().parents[2] / "pipelines" / "demo.toml"
    run_dir = tmp_path / "demo"
    sets = [
        f"run_dir={run_dir}",
        "iterations=1",
        "generate.prompts_per_iteration=8",
        "eval.prompts={run_dir}/data/prompts.jsonl",
        "eval.n=2",
    ]
    run_pipeline(demo, sets, quiet=True)
    for it in (0, 1):  # iteration 0's policy and the last one's
        assert (run_dir / f"iter={it:04d}" / "eval" / "_manifest.json").is_file()
