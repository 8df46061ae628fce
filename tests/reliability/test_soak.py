"""The random soak (`make soak`): `rlhf-batch run` SIGKILLed at seeded random moments, over and
over, until it completes; every completed run directory must equal the reference run. One run
directory in three uses the default subprocess-per-stage mode, where the kill hits `run` and
its stage process must die with it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.reliability.harness import WALL, Assets, assert_same_as_reference, command, kill_after

SEED = 20261122
MIN_KILLS = int(os.environ.get("RLHF_BATCH_SOAK_KILLS", "24"))  # `make test` runs a short soak of 6


@pytest.mark.soak
@pytest.mark.slow
def test_random_kills_never_change_the_result(assets: Assets, reference: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    kills, dirs = 0, 0
    while kills < MIN_KILLS:
        run_dir = tmp_path / f"run{dirs}"
        extra = ["--set", "in_process=false"] if dirs % 3 == 2 else []
        dirs += 1
        # ~3 s of imports, then a few s of work (twice that in the subprocess mode, which starts a
        # process per stage, imports each time): the kills land in every stage and during start-up
        latest = window(WALL["reference"], 12.0)
        kills += kill_until_complete(command(assets, run_dir, *extra), rng, 2 * latest if extra else latest)
        assert_same_as_reference(run_dir, reference)
    print(f"soak: {kills} SIGKILLs at random moments over {dirs} run directories, all equal to the reference")


def window(uninterrupted: float, least: float) -> float:
    """Kills land up to 1.5x an uninterrupted run's time, at least `least` s after the start: on a
    slow or busy machine a fixed window would let no run get far enough between kills."""
    return max(least, 1.5 * uninterrupted)


def kill_until_complete(cmd: list[str], rng: random.Random, latest: float) -> int:
    """Run `cmd`, SIGKILLed after 1..`latest` s, until it completes; the kills that landed."""
    for kills in range(100):
        if kill_after(cmd, rng.uniform(1.0, latest)) == 0:
            return kills
    pytest.fail(f"{cmd}: 100 kills and still not complete")


def _features(assets: Assets) -> list[str]:
    """Top-up rounds (16 prompts an iteration, 16 informative groups wanted, one round at most),
    LoRA, keep_policies = 1 (iteration 0's policy removed once iteration 1 is trained) and eval of
    every iteration: all on at once."""
    sets = [
        "generate.prompts_per_iteration=16",
        "advantage.min_groups=16",
        "advantage.max_topup_rounds=1",
        "lora.enabled=true",
        "lora.r=4",
        "lora.alpha=8",
        "keep_policies=1",
        f"eval.prompts={assets.prompts}",
        "eval.n=2",
        "eval.every=1",
        "eval.prompts_per_part=16",
    ]
    return [a for s in sets for a in ("--set", s)]


def _same_extras(run_dir: Path, ref: Path) -> None:
    """Eval and top-up folders: the same parts' rows as the uninterrupted run."""
    import pyarrow.parquet as pq

    from rlhf_batch.store import layout, manifests

    folders = sorted(
        str(m.parent.relative_to(ref))
        for m in ref.glob("iter=*/**/_manifest.json")
        if "topup=" in str(m) or "/eval/" in str(m)
    )
    assert any("topup=" in f for f in folders) and any("eval" in f for f in folders), folders
    for f in folders:
        got, want = (manifests.manifest(d / f) for d in (run_dir, ref))
        assert got is not None and got["key"] == want["key"], f
        for part in want["parts"]:
            a, b = (pq.read_table(d / f / part["file"]) for d in (run_dir, ref))
            assert a.equals(b), f"{f}/{part['file']}"
    assert not list(run_dir.rglob(".*.new")) and not [p for p in run_dir.rglob(".*") if layout.is_tmp(p.name)]


@pytest.mark.soak
@pytest.mark.slow
def test_random_kills_with_topup_lora_retention_and_eval_on(assets: Assets, tmp_path: Path) -> None:
    from tests.reliability.harness import run_to_completion

    rng = random.Random(SEED + 1)
    ref = tmp_path / "reference"
    latest = window(run_to_completion(assets, ref, *_features(assets)), 20.0)
    kills, dirs = 0, 0
    while kills < MIN_KILLS:
        run_dir = tmp_path / f"run{dirs}"
        extra = [*_features(assets), *(["--set", "in_process=false"] if dirs % 3 == 2 else [])]
        dirs += 1
        kills += kill_until_complete(command(assets, run_dir, *extra), rng, latest)
        assert_same_as_reference(run_dir, ref)
        _same_extras(run_dir, ref)
    print(
        f"soak (every feature on): {kills} SIGKILLs over {dirs} run directories, all equal to the reference"
    )
