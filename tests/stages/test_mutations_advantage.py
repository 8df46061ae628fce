"""The advantage stage on scores that are NOT in rollouts order (the pool is joined on
rollout_id) and, for comparison, in rollouts order (the positional pool): a NaN reward and
truncated = "drop" must act the same on both. Rollouts come from `import`, rewards from the
demo reward function, one reward is set to NaN by editing the scores file; expected
advantages are worked out by hand below."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest

from tests.stages.cli_helpers import ok, part_files, read, rewrite, stage

# letter_count with letter "a", count 2: hits among the first 2 characters / max(2, len)
# "aa" -> 2/2 = 1.0, "ab" -> 1/2 = 0.5, "bb" -> 0/2 = 0.0
ROWS = [  # prompt_id, response, finish_reason
    ("p", "aa", "stop"),  # p-0: 1.0
    ("p", "ab", "stop"),  # p-1: 0.5
    ("p", "bb", "stop"),  # p-2: 0.0
    ("p", "aa", "stop"),  # p-3: 1.0, set to NaN in the scores file
    ("q", "aa", "stop"),  # q-0: 1.0
    ("q", "ab", "stop"),  # q-1: 0.5
    ("q", "bb", "length"),  # q-2: 0.0, truncated
    ("q", "aa", "length"),  # q-3: 1.0, truncated
]
# eps = 0, sample std (ddof 1), truncated = "drop":
# p without the NaN row: {1, 0.5, 0}, mean 0.5, var (0.25 + 0 + 0.25) / 2 = 0.25, std 0.5
#   -> p-0 (1 - 0.5) / 0.5 = 1, p-1 0, p-2 -1
# q without the truncated rows: {1, 0.5}, mean 0.75, var (0.0625 + 0.0625) / 1 = 0.125,
#   std sqrt(0.125) = 0.3535534 -> q-0 0.25 / 0.3535534 = 0.7071068, q-1 -0.7071068
EXPECTED = {
    "0000-p-0": 1.0,
    "0000-p-1": 0.0,
    "0000-p-2": -1.0,
    "0000-q-0": 0.7071068,
    "0000-q-1": -0.7071068,
}


@pytest.mark.parametrize("order", ["reversed", "rollouts order"])
def test_nan_reward_and_dropped_truncation_whatever_the_order_of_the_scores(
    make_config, tmp_path: Path, order: str
) -> None:
    src = tmp_path / "rollouts.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "prompt_id": p,
                    "prompt": f"{p}=",
                    "response": r,
                    "finish_reason": f,
                    "letter": "a",
                    "count": 2,
                }
            )
            + "\n"
            for p, r, f in ROWS
        )
    )
    path, cfg = make_config(advantage={"truncated": "drop", "eps": 0.0})
    ok("import", src, "--config", path, "--iter", 0, "--quiet")
    stage(path, "score")
    (part,) = part_files(cfg.run_dir, "scores")
    scores = read(cfg.run_dir, "scores")
    ids = scores["rollout_id"].to_pylist()
    assert ids == [f"0000-{p}-{i % 4}" for i, (p, _, _) in enumerate(ROWS)]
    assert scores["reward"].to_pylist() == [1.0, 0.5, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0]  # kl is 0: ref = policy
    reward = scores["reward"].to_pylist()
    reward[ids.index("0000-p-3")] = math.nan
    scores = scores.set_column(
        scores.schema.get_field_index("reward"), "reward", pa.array(reward, pa.float64())
    )
    if order == "reversed":
        scores = scores.take(list(range(len(ids) - 1, -1, -1)))
    rewrite(part, scores)
    stage(path, "advantage")
    rows = {r["rollout_id"]: r for r in read(cfg.run_dir, "advantages").to_pylist()}
    assert sorted(rows) == sorted(EXPECTED)
    for rid, adv in EXPECTED.items():
        assert rows[rid]["advantage"] == pytest.approx(adv, abs=1e-6), rid
    assert (rows["0000-p-0"]["group_size"], rows["0000-p-0"]["group_mean"]) == (3, 0.5)
    assert (rows["0000-q-0"]["group_size"], rows["0000-q-0"]["group_mean"]) == (2, 0.75)
    counts = json.loads(
        (Path(part_files(cfg.run_dir, "advantages")[0]).parent / "_manifest.json").read_text()
    )["counts"]
    assert {k: counts[k] for k in ("rows_in", "unscored", "truncated", "truncated_dropped", "rows_out")} == {
        "rows_in": 8,
        "unscored": 1,
        "truncated": 2,
        "truncated_dropped": 2,
        "rows_out": 5,
    }
