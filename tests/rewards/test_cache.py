"""The reward cache (rewards/cache.py) and async reward functions (rewards/concurrent.py) on real
Parquet files: a cached re-score equals a fresh one bit for bit, a changed source or a changed
rollout misses, concurrent writers merge, async calls keep row order under their limits."""

from __future__ import annotations

import importlib
import struct
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from rlhf_batch.config import load_config
from rlhf_batch.errors import ConfigError, RewardError
from rlhf_batch.rewards import load_reward_functions
from rlhf_batch.rewards.cache import FOLDER, RewardCache, RewardCalls

SYNC = """
CALLS = []

def judge(*, responses, answer, **_):
    CALLS.append(len(responses))
    return [len(r) / 3 + (0.1 if r.endswith(a) else 0.2) for r, a in zip(responses, answer)]

def detail(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(1)
    if solution_str == "none":
        return None
    return {"score": len(solution_str) / 7, "ok": solution_str.endswith(ground_truth),
            "why": "long" if len(solution_str) > 3 else len(solution_str)}
"""

ASYNC = """
import asyncio, time
STARTS, LIVE = [], [0, 0]

async def judge(*, responses, answer, **_):
    STARTS.append(time.monotonic())
    LIVE[0] += 1
    LIVE[1] = max(LIVE[1], LIVE[0])
    await asyncio.sleep(0.02 * (len(responses[0]) % 3))  # later rows may finish first
    LIVE[0] -= 1
    if responses[0] == "boom":
        raise ValueError("judge unreachable")
    return [len(responses[0]) / 3 + (0.1 if responses[0].endswith(answer[0]) else 0.2)]
"""

RESPONSES = ["a7", "xx", "a7", "long7", "q", "seven 7"]


def module(tmp_path: Path, name: str, text: str):  # noqa: ANN201
    (tmp_path / f"{name}.py").write_text(text)
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    if name in sys.modules:
        return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def batch(responses: list[str]) -> dict:
    n = len(responses)
    return {
        "prompts": ["what is 3+4?"] * n,
        "responses": responses,
        "prompt_ids": [[1, 2, 3]] * n,
        "response_ids": [[ord(c) % 50 for c in r] for r in responses],
        "columns": {"answer": ["7"] * n, "ground_truth": ["7"] * n, "data_source": ["m"] * n},
    }


def bits(values: list) -> list:
    return [None if v is None else struct.pack("<d", v) for v in values]


def rids(n: int) -> list[str]:
    return [f"0-p-{i}" for i in range(n)]


def test_cached_rescore_equals_fresh_bit_for_bit(tmp_path: Path) -> None:
    mod = module(tmp_path, "cache_judge_a", SYNC)
    fns = load_reward_functions(["cache_judge_a:judge"])
    fresh, _ = RewardCalls().values(fns, rids(6), batch(RESPONSES))
    # hand-worked: "a7" -> 2/3 + 0.1, "xx" -> 2/3 + 0.2, "long7" -> 5/3 + 0.1, "q" -> 1/3 + 0.2
    assert fresh["reward_judge"][:2] == [2 / 3 + 0.1, 2 / 3 + 0.2]
    root = tmp_path / "run" / FOLDER
    first = RewardCalls(cache=RewardCache(root))
    cached, _ = first.values(fns, rids(6), batch(RESPONSES))
    assert bits(cached["reward_judge"]) == bits(fresh["reward_judge"])
    assert first.take_counts() == {
        "reward_cache_hits": 0, "reward_cache_misses": 6,
        "reward_cache_hits_judge": 0, "reward_cache_misses_judge": 6,
    }  # fmt: skip
    mod.CALLS.clear()
    again = RewardCalls(cache=RewardCache(root))  # a new process: read from the Parquet files
    replay, _ = again.values(fns, rids(6), batch(RESPONSES))
    assert mod.CALLS == []  # every verdict came from the cache
    assert again.take_counts()["reward_cache_hits"] == 6
    assert bits(replay["reward_judge"]) == bits(fresh["reward_judge"])
    files = list((root / "judge").glob("*/part-*.parquet"))
    assert len(files) == 1 and pa.parquet.read_table(files[0]).num_rows == 5  # "a7" twice: one key


def test_changed_source_invalidates_and_changed_content_misses(tmp_path: Path) -> None:
    module(tmp_path, "cache_judge_b", SYNC)
    root = tmp_path / "run" / FOLDER
    fns = load_reward_functions(["cache_judge_b:judge"])
    RewardCalls(cache=RewardCache(root)).values(fns, rids(6), batch(RESPONSES))
    changed = ["a7", "xx", "a7", "long7", "q", "seven 8"]  # one response differs
    calls = RewardCalls(cache=RewardCache(root))
    out, _ = calls.values(fns, rids(6), batch(changed))
    counts = calls.take_counts()
    assert (counts["reward_cache_hits"], counts["reward_cache_misses"]) == (5, 1)
    assert out["reward_judge"][5] == 7 / 3 + 0.2  # the new response's own value, not the old one's
    # the same function name, another source: a new folder, every row a miss
    mod = module(tmp_path, "cache_judge_b", SYNC.replace("0.2)", "0.25)"))
    fns = load_reward_functions(["cache_judge_b:judge"])
    calls = RewardCalls(cache=RewardCache(root))
    out, _ = calls.values(fns, rids(6), batch(RESPONSES))
    assert calls.take_counts()["reward_cache_misses"] == 6 and mod.CALLS == [6]
    assert out["reward_judge"][1] == 2 / 3 + 0.25
    assert len(list((root / "judge").iterdir())) == 2


def test_verl_extras_and_partial_hits_equal_a_fresh_batch(tmp_path: Path) -> None:
    module(tmp_path, "cache_judge_c", SYNC)
    fns = load_reward_functions(["verl:cache_judge_c:detail"])
    root = tmp_path / "run" / FOLDER
    whole = ["a7", "xx", "none", "long7", "q"]
    fresh_v, fresh_x = RewardCalls().values(fns, rids(5), batch(whole))
    # half the rows first (only numbers in `why`: float64 there), then the whole batch: the hits
    # must still give the text column a fresh batch gives ("long" makes `why` text)
    RewardCalls(cache=RewardCache(root)).values(fns, rids(2), batch(whole[:2]))
    calls = RewardCalls(cache=RewardCache(root))
    v, x = calls.values(fns, rids(5), batch(whole))
    assert calls.take_counts()["reward_cache_hits"] == 2
    assert bits(v["reward_detail"]) == bits(fresh_v["reward_detail"])
    assert list(x) == list(fresh_x) == ["reward_detail_ok", "reward_detail_why"]
    for c in x:
        assert x[c].equals(fresh_x[c]), c
    assert x["reward_detail_why"].to_pylist() == ["2", "2", None, "long", "1"]
    assert fresh_x["reward_detail_ok"].type == pa.bool_()


def test_two_writers_merge_at_read(tmp_path: Path) -> None:
    """Two ranks of a fan-out score their own rows into one folder; a later reader hits both."""
    module(tmp_path, "cache_judge_d", SYNC)
    fns = load_reward_functions(["cache_judge_d:judge"])
    root = tmp_path / "run" / FOLDER
    rank0, rank1 = RewardCalls(cache=RewardCache(root)), RewardCalls(cache=RewardCache(root))
    rank0.values(fns, rids(3), batch(RESPONSES[:3]))
    rank1.values(fns, rids(3), batch(RESPONSES[3:]))
    assert len(list((root / "judge").glob("*/part-*.parquet"))) == 2
    reader = RewardCalls(cache=RewardCache(root))
    reader.values(fns, rids(6), batch(RESPONSES))
    assert reader.take_counts()["reward_cache_hits"] == 6


def test_async_functions_keep_row_order_under_limits(tmp_path: Path) -> None:
    mod = module(tmp_path, "cache_judge_e", ASYNC)
    sync = module(tmp_path, "cache_judge_f", SYNC)
    fns = load_reward_functions(["cache_judge_e:judge"])
    calls = RewardCalls(concurrency=2, rate_per_s=50.0)
    out, _ = calls.values(fns, rids(6), batch(RESPONSES))
    expected = sync.judge(responses=RESPONSES, answer=["7"] * 6)
    assert bits(out["reward_judge"]) == bits(expected)
    assert mod.LIVE[1] == 2  # never more than reward_concurrency in flight
    # 50 a second: call k starts no earlier than k x 20 ms after the first (5 ms for the first's lag)
    assert len(mod.STARTS) == 6
    assert all(s - mod.STARTS[0] >= k * 0.02 - 0.005 for k, s in enumerate(mod.STARTS))
    with pytest.raises(
        RewardError, match=r"cache_judge_e:judge raised ValueError: judge unreachable \(rollout 0-p-1\)"
    ):
        calls.values(fns, rids(3), batch(["a7", "boom", "q"]))


def test_config_keys_are_checked(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[score]\nreward_concurrency = 0\n")
    with pytest.raises(ConfigError, match="score.reward_concurrency"):
        load_config(cfg)
    cfg.write_text("[score]\nreward_rate_per_s = -1.0\n")
    with pytest.raises(ConfigError, match="score.reward_rate_per_s"):
        load_config(cfg)


def test_async_calls_end_at_the_timeout(tmp_path: Path) -> None:
    module(tmp_path, "cache_judge_g", "import asyncio\n\nasync def slow(**_):\n    await asyncio.sleep(30)\n")
    fns = load_reward_functions(["cache_judge_g:slow"])
    with pytest.raises(
        RewardError, match=r"cache_judge_g:slow did not return within 0.3 s \(score.reward_timeout\)"
    ):
        RewardCalls(timeout=0.3).values(fns, rids(2), batch(["a", "b"]))


CARRIED = """
def judge(*, responses, answer, env_solved, **_):
    return [float(r.endswith(a)) + 10 * s for r, a, s in zip(responses, answer, env_solved)]
"""


def test_carried_columns_are_part_of_the_key_within_a_batch_and_across(tmp_path: Path) -> None:
    """Rows with the same prompt, response and token ids but another `answer` or environment part
    (`env_*`) are different rollouts to a reward function: each gets its own verdict."""
    module(tmp_path, "cache_judge_carried", CARRIED)
    fns = load_reward_functions(["cache_judge_carried:judge"])
    b = batch(["a7"] * 3)
    b["columns"] = {"answer": ["7", "8", "7"], "env_solved": [0.0, 0.0, 1.0]}
    root = tmp_path / "run" / FOLDER
    calls = RewardCalls(cache=RewardCache(root))
    out, _ = calls.values(fns, rids(3), b)
    # by hand: "a7" ends with "7" -> 1 + 10 * 0; not with "8" -> 0 + 0; "7" and solved -> 1 + 10
    assert out["reward_judge"] == [1.0, 0.0, 11.0]
    assert calls.take_counts()["reward_cache_misses"] == 3
    # a later batch: the second row's answer and the third's part changed, the first row is a hit
    b["columns"] = {"answer": ["7", "7", "7"], "env_solved": [0.0, 0.0, 0.0]}
    calls = RewardCalls(cache=RewardCache(root))
    out, _ = calls.values(fns, rids(3), b)
    assert out["reward_judge"] == [1.0, 1.0, 1.0]
    counts = calls.take_counts()
    assert (counts["reward_cache_hits"], counts["reward_cache_misses"]) == (3, 0)
