"""Writes the example prompt sets in the two ecosystem forms (run from the repository root):

    python tests/data/make_examples.py

trl_conversational.jsonl  TRL's conversational prompt form: `prompt` is a list of {role, content},
                          every other column (here `solution`) is passed to reward functions.
verl_math.parquet         verl's RL Parquet: data_source, prompt (messages), ability,
                          reward_model {style, ground_truth}, extra_info {split, index}.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent
QUESTIONS = [("1/3", "\\frac{1}{3}"), ("2/4", "\\frac{1}{2}"), ("6/3", "2"), ("3/4", "\\frac{3}{4}")]


def main() -> None:
    with open(HERE / "trl_conversational.jsonl", "w") as f:
        for q, a in QUESTIONS:
            row = {"prompt": [{"role": "user", "content": f"Simplify {q}."}], "solution": a}
            f.write(json.dumps(row) + "\n")
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    table = pa.table(
        {
            "data_source": ["example/frac"] * len(QUESTIONS),
            "prompt": pa.array(
                [[{"content": f"Simplify {q}.", "role": "user"}] for q, _ in QUESTIONS], pa.list_(message)
            ),
            "ability": ["math"] * len(QUESTIONS),
            "reward_model": pa.array(
                [{"ground_truth": a, "style": "rule"} for _, a in QUESTIONS],
                pa.struct([("ground_truth", pa.string()), ("style", pa.string())]),
            ),
            "extra_info": pa.array(
                [{"index": i, "split": "train"} for i in range(len(QUESTIONS))],
                pa.struct([("index", pa.int64()), ("split", pa.string())]),
            ),
        }
    )
    pq.write_table(table, HERE / "verl_math.parquet")


if __name__ == "__main__":
    main()
