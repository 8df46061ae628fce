"""score with `score.reward_cache`: the scores table is the one without a cache, bit for bit, on
the run that fills the cache and on a `--force` re-score that reads it; the manifest counts hits
and misses (and has no such counts with the cache off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import SCORES
from tests.stages.test_score import HERE, write_rollouts


def table(cfg):  # noqa: ANN001, ANN201
    return manifests.read_complete(layout.folder(cfg.run_dir, 0, "scores"), SCORES)


def test_cached_rescore_equals_uncached_score(make_config) -> None:
    fns = [f"{HERE}:length_reward", f"{HERE}:token_reward", "rlhf_batch.rewards.demo:letter_count"]
    score = {"reward_functions": fns, "reward_weights": [0.1, 1e-3, 1.0], "rows_per_part": 5}
    _, off = make_config(score=score)
    _, on = make_config(score={**score, "reward_cache": True}, name="cached.toml")
    write_rollouts(off)
    m = run_stage("score", off, 0, quiet=True)
    fresh = table(off)
    assert not any(k.startswith("reward_cache") for k in m["counts"])  # off: the manifest as before
    m = run_stage("score", on, 0, force=True, quiet=True)  # fills the cache: 12 rollouts x 3 functions
    assert (m["counts"]["reward_cache_hits"], m["counts"]["reward_cache_misses"]) == (0, 36)
    assert table(on).equals(fresh)
    m = run_stage("score", on, 0, force=True, quiet=True)  # every verdict from the cache
    assert (m["counts"]["reward_cache_hits"], m["counts"]["reward_cache_misses"]) == (36, 0)
    assert m["counts"]["reward_cache_hits_length_reward"] == 12
    assert table(on).equals(fresh)


@pytest.mark.slow  # a whole `run` (eval twice, two rounds, advantage, train, the report) on 16 rollouts
def test_eval_and_a_topup_round_reuse_the_verdicts_of_earlier_stages(make_config, tmp_path) -> None:
    """One `run` of 1 iteration, eval before and after it, sampling with top_k = 1 (every sample
    of a prompt is its most likely response: the same tokens in generate, a top-up round and
    eval, whose parts are alike: 2 prompts x 4 samples). The prompt "d*1=" is there twice (p0 in
    part 0, p2 in part 1). By hand, 4 prompts x 4 samples = 16 rollouts per stage, 1 reward
    function, every group constant (so one top-up round, the cap: min_groups 1 is never met),
    and the policy carried forward unchanged (no trainable row):

    * eval of iteration 0 runs first: part 0 misses 8; part 1 hits p2's 4 samples (p0's
      contents, stored by part 0) and misses p3's 4: 4 hits, 12 misses;
    * score of round 0: the same 16 contents, 16 hits;
    * score of top-up round 1 (sample indices 4..7, the same contents): 16 hits;
    * eval of iteration 1 (the carried policy, the same weights): 16 hits."""
    from rlhf_batch.commands.pipeline import run_pipeline

    prompts = tmp_path / "four.jsonl"
    rows = [("p0", "d*1=", "d", 1), ("p1", "c*2=", "c", 2), ("p2", "d*1=", "d", 1), ("p3", "a*3=", "a", 3)]
    prompts.write_text(
        "".join(json.dumps({"id": i, "prompt": p, "letter": x, "count": c}) + "\n" for i, p, x, c in rows)
    )
    path, cfg = make_config(
        score={"reward_cache": True, "kl_in_reward": False},
        generate={"prompts": str(prompts), "top_k": 1, "prompts_per_part": 2, "num_generations": 4},
        advantage={"min_groups": 1, "max_topup_rounds": 1},
        eval={"prompts": str(prompts), "n": 4, "top_k": 1, "prompts_per_part": 2},
        iterations=1,
        in_process=True,
    )
    run_pipeline(path, [], quiet=True)

    def counts(it: int, folder: str, topup: int = 0) -> tuple[int, int]:
        c = manifests.manifest(layout.folder(cfg.run_dir, it, folder, topup))["counts"]
        return c["reward_cache_hits"], c["reward_cache_misses"]

    assert counts(0, "eval") == (4, 12)
    assert counts(0, "scores") == (16, 0)
    assert counts(0, "scores", 1) == (16, 0)
    assert counts(1, "eval") == (16, 0)


@pytest.mark.slow  # a child process to kill: its start-up (torch, transformers) is most of it
def test_a_killed_cached_score_resumes_to_the_uninterrupted_table(make_config, tmp_path) -> None:
    """score with the cache, killed while writing part 1 (rows 5-9): part 0 is on disk, and so
    are the verdicts part 1 computed (the cache is written before the part). The resumed run
    writes parts 1 and 2 and equals a score without the cache; by hand its manifest counts, 3
    functions a rollout: part 0 missed 5 x 3 = 15, part 1 hits its 5 x 3 = 15 stored verdicts,
    part 2 misses 2 x 3 = 6: 15 hits, 21 misses."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rlhf_batch.runtime import faults

    fns = [f"{HERE}:length_reward", f"{HERE}:token_reward", "rlhf_batch.rewards.demo:letter_count"]
    score = {"reward_functions": fns, "reward_weights": [0.1, 1e-3, 1.0], "rows_per_part": 5}
    _, off = make_config(score=score, run_dir=str(tmp_path / "uncached"))
    path, on = make_config(score={**score, "reward_cache": True}, name="cached.toml")
    write_rollouts(off)
    write_rollouts(on)
    run_stage("score", off, 0, quiet=True)
    fresh = table(off)
    env = {**os.environ, faults.FAULT_ENV: "scores:part-1:tmp", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "rlhf_batch", "score", str(path), "--iter", "0", "--quiet"]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr
    sdir = layout.folder(on.run_dir, 0, "scores")
    assert [p.name for p in layout.list_parts(sdir)] == ["part-00000-00000.parquet"]
    m = run_stage("score", on, 0, quiet=True)
    assert (m["counts"]["reward_cache_hits"], m["counts"]["reward_cache_misses"]) == (15, 21)
    assert table(on).equals(fresh)


def test_a_nan_read_back_from_the_cache_is_refused_not_scored(make_config) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_batch.errors import StageError
    from rlhf_batch.rewards.cache import SCHEMA

    _, cfg = make_config(score={"reward_functions": [f"{HERE}:length_reward"], "reward_cache": True})
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    (f,) = (Path(cfg.run_dir) / layout.REWARD_CACHE).rglob("part-*.parquet")
    t = pq.read_table(f)
    values = [float("nan")] + t["value"].to_pylist()[1:]  # one verdict corrupted on disk
    pq.write_table(t.set_column(1, "value", pa.array(values, pa.float64())).cast(SCHEMA), f)
    with pytest.raises(StageError, match=rf"^{f}: a reward cache value is nan .*not a finite number"):
        run_stage("score", cfg, 0, force=True, quiet=True)
