"""The random soak (`make soak`): `rlhf-batch run` SIGKILLed at seeded random moments, over and
over, until it completes; every completed run directory must equal the reference run. One run
directory in three uses the default subprocess-per-stage mode, where the kill hits `run` and
its stage process must die with it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.reliability.harness import Assets, assert_same_as_reference, command, kill_after

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
        for _ in range(100):
            # ~3 s of imports, then ~10 s of work (~30 s in the subprocess mode): the kills land in every stage, and during start-up
            if kill_after(command(assets, run_dir, *extra), rng.uniform(1.0, 12.0)) == 0:
                break
            kills += 1
        else:
            pytest.fail(f"{run_dir}: 100 kills and still not complete")
        assert_same_as_reference(run_dir, reference)
    print(f"soak: {kills} SIGKILLs at random moments over {dirs} run directories, all equal to the reference")
