"""A run directory on an object store: a real S3-protocol server on 127.0.0.1 (moto's, started by
the tests), reached through s3fs exactly as S3 or MinIO would be."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout
from rlhf_batch.store.fs import run_path


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *args], capture_output=True, text=True, env=env, timeout=900
    )


def rows(run_dir: str, stage: str) -> list[tuple]:
    """Every row of a stage over all iterations, as plain values, sorted by rollout."""
    import duckdb

    from rlhf_batch.store.fs import register

    root = run_path(run_dir)
    con = duckdb.connect()
    register(con, root)
    cols = {  # every column but paths (the policy that sampled is named by its path)
        "rollouts": "rollout_id, response_ids, behavior_logprobs",
        "scores": "rollout_id, score, reward, ref_logprobs, kl_sum",
        "advantages": "rollout_id, advantage",
    }[stage]
    rel = con.sql(
        f"SELECT {cols} FROM read_parquet('{root}/iter=*/{stage}/part-*.parquet') ORDER BY rollout_id"
    )
    return rel.fetchall()


def weights(run_dir: str, it: int) -> dict:
    from safetensors.torch import load

    return load((run_path(run_dir) / f"iter={it:04d}" / "policy" / "model.safetensors").read_bytes())


@pytest.mark.slow
def test_a_run_on_s3_equals_the_same_run_on_local_disk(make_config, s3_run: str, tmp_path: Path) -> None:
    settings = {  # as pipelines/demo.toml: the demo builds its model and prompts in the run dir
        "iterations": 2,
        "threads": 1,
        "in_process": True,
        "demo": True,
        "policy_model": "{run_dir}/models/policy",
        "generate": {"prompts": "{run_dir}/data/prompts.jsonl", "prompts_per_iteration": 12},
        "train": {"lr": 1e-3, "tokens_per_step": 256},
    }
    local, local_cfg = make_config(name="local.toml", **settings)
    remote, remote_cfg = make_config(name="s3.toml", run_dir=s3_run, **settings)
    assert remote_cfg.run_dir == s3_run and remote_cfg.policy_model == f"{s3_run}/models/policy"  # URIs
    assert run("run", str(local), "--quiet").returncode == 0
    done = run("run", str(remote), "--quiet")
    assert done.returncode == 0, done.stderr
    assert not Path("s3:").exists() and not (tmp_path / "s3:").exists()  # never a local folder named s3:
    for built in ("models/policy/model.safetensors", "data/prompts.jsonl"):  # on the store, as locally
        assert (run_path(s3_run) / built).read_bytes() == (Path(local_cfg.run_dir) / built).read_bytes()
    for stage in ("rollouts", "scores", "advantages"):
        assert rows(s3_run, stage) == rows(local_cfg.run_dir, stage), stage
    for it in (0, 1):
        a, b = weights(s3_run, it), weights(local_cfg.run_dir, it)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # a second run does nothing: every stage is complete on the store
    before = {str(p): p.read_text() for p in run_path(s3_run).glob("iter=*/*/_manifest.json")}
    assert len(before) == 8
    assert not any("testing" in text for text in before.values())  # the test credentials are nowhere
    assert run("run", str(remote), "--quiet").returncode == 0
    assert {str(p): p.read_text() for p in run_path(s3_run).glob("iter=*/*/_manifest.json")} == before
    assert not any(layout.LOCK in str(p) for p in run_path(s3_run).iterdir())  # the lock was released


@pytest.mark.slow
def test_each_iteration_of_a_run_on_s3_makes_the_same_requests(make_config, s3_server, s3_run: str) -> None:
    """`run` in process on the store, 5 iterations, two reward parts (the reward-health check runs
    after every train): the requests each iteration makes, counted on the server (the run lock's
    time-driven renewals left out), do not grow with the iterations before it. From iteration 3
    on the check reads its own iteration and the one 3 back (observe/health.py's window), so
    iterations 3 and 4 differ by at most a few (measured: 495, 624, 624, 769, 768 for iterations
    0-4); before, the check listed the run and read every earlier iteration's files again (+13
    requests an iteration, and growing)."""
    from rlhf_batch.commands import pipeline

    functions = ["tests.stages.test_score:length_reward", "tests.stages.test_score:token_reward"]
    path, _ = make_config(
        run_dir=s3_run, iterations=5, threads=1, in_process=True, score={"reward_functions": functions}
    )
    counts: dict[int, int] = {}
    inner = pipeline.run_iteration

    def counted(cfg: object, it: int, *args: object, **kw: object) -> None:
        before = len(s3_server.requests())
        inner(cfg, it, *args, **kw)
        counts[it] = sum(1 for r in s3_server.requests()[before:] if ".run.lock" not in r["path"])

    pipeline.run_iteration = counted  # type: ignore[assignment]
    try:
        pipeline.run_pipeline(path, [], quiet=True)
    finally:
        pipeline.run_iteration = inner  # type: ignore[assignment]
    assert counts[3] > 0 and abs(counts[4] - counts[3]) <= 4, counts
