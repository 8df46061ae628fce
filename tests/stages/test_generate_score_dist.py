"""Two real ranks (torchrun, gloo on CPU) of generate and score write the rows of one rank.

torchrun runs this file as its script (see the bottom): each rank joins the process group as
the CLI does and runs generate, then score, in one process, which saves a second start-up of
transformers (~10 s of imports per process on 2 cores). The CLI path under torchrun is
covered by test_train_dist.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import torch

from rlhf_batch.config import load_config
from rlhf_batch.runtime import dist
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS, SCORES

REPO = Path(__file__).parents[2]


def generate_and_score(config: str | Path) -> None:
    cfg = load_config(config)
    dist.init(cfg.device)
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)


def rows(run_dir: str, stage: str, schema: pa.Schema) -> list[dict]:
    sdir = layout.folder(run_dir, 0, stage)
    return manifests.read_complete(sdir, schema).sort_by("rollout_id").to_pylist()


def test_two_ranks_write_the_rows_of_one_rank(make_config, tiny_model: Path, tmp_path: Path) -> None:
    # a copy of the policy under another path as the reference: score runs real reference
    # forward passes (kl ~1e-6, not the exact-0 copy of the behaviour log-probs)
    ref = shutil.copytree(tiny_model, tmp_path / "ref")
    # 12 prompts x G=4: 3 rollouts parts (5 prompts each) and 5 scores parts (10 rows each),
    # so both ranks write parts, and not the same number of them
    score = {
        "rows_per_part": 10,
        "kl_in_reward": True,
        "reward_functions": ["rlhf_batch.rewards.demo:letter_count"],
    }
    keys = dict(ref_model=str(ref), score=score)
    path, two = make_config(run_dir=str(tmp_path / "two"), **keys)
    _, one = make_config(run_dir=str(tmp_path / "one"), name="one.toml", **keys)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([*cmd, __file__, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1): the same float sums
    try:
        generate_and_score(tmp_path / "one.toml")
    finally:
        torch.set_num_threads(threads)

    for stage, schema in (("rollouts", ROLLOUTS), ("scores", SCORES)):
        m = manifests.manifest(layout.folder(two.run_dir, 0, stage))
        assert m is not None
        assert {p["file"][5:10] for p in m["parts"]} == {"00000", "00001"}  # part-RRRRR-: both ranks
        a, b = rows(two.run_dir, stage, schema), rows(one.run_dir, stage, schema)
        assert len(a) == len(b) == 48 and len(a[0]) == len(b[0]) > len(schema.names)  # + extras
        assert a == b, stage  # every column, floats bit for bit
    assert any(x != 0 for r in rows(two.run_dir, "scores", SCORES) for x in r["kl"])


if __name__ == "__main__":  # a torchrun rank
    torch.set_num_threads(1)
    generate_and_score(sys.argv[1])
