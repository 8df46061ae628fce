"""A policy's fingerprint is its weights: a policy this package writes carries the sha256 of its
weight files (computed once, when written), and the stages that read it record that hash, so
re-training an iteration with other weights makes the next iteration's stages out of date
instead of complete."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from rlhf_batch.config import load_config
from rlhf_batch.stages.executor import is_done
from rlhf_batch.stages.registry import get
from rlhf_batch.store import layout
from rlhf_batch.store.modeldir import WEIGHTS_DIGEST, model_fingerprint
from tests.reliability.harness import environment


def rb(*args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rlhf_batch", *map(str, args)]
    return subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_retraining_with_other_weights_makes_the_next_iteration_out_of_date(make_config) -> None:
    path, cfg = make_config(iterations=2, in_process=True, threads=1)
    assert rb("run", path, "--quiet").returncode == 0
    pol = layout.policy_dir(cfg.run_dir, 0)
    # the digest beside the weights is the sha256 of the file's bytes, computed here independently
    digest = json.loads((pol / WEIGHTS_DIGEST).read_text())
    weights = pol / "model.safetensors"
    assert digest["model.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    before = model_fingerprint(str(pol), "policy")
    cfg = load_config(path)
    assert all(is_done(get(s)(cfg, 1)) for s in ("generate", "train"))

    res = rb("train", path, "--iter", 0, "--force", "--quiet", "--set", "train.lr=0.02")
    assert res.returncode == 0, res.stderr[-2000:]
    after = model_fingerprint(str(pol), "policy")
    assert after["weights"] == before["weights"]  # same file names and sizes ...
    assert after["content"] != before["content"]  # ... other weights
    # iteration 1 was generated (and trained) from the old weights: not complete any more
    assert not is_done(get("generate")(cfg, 1))
    res = rb("generate", path, "--iter", 1, "--quiet")
    assert res.returncode == 1 and "inputs.policy" in res.stderr and "--force" in res.stderr, res.stderr
