"""score with `score.reward_cache`: the scores table is the one without a cache, bit for bit, on
the run that fills the cache and on a `--force` re-score that reads it; the manifest counts hits
and misses (and has no such counts with the cache off)."""

from __future__ import annotations

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
