"""`run` with `max_staleness = S > 0`: overlapped iterations in two lanes.

The sample lane runs generate and score of iteration K as soon as the policy K samples from
(that of iteration K-1-S, models.policy) is trained; the learn lane runs the dynamic-sampling
top-up rounds, advantage and train of iteration K once score K is complete, and eval. Each lane
is a process of its own (`rlhf-batch lane sample|learn`, started by `run` only:
pipeline.run_lane), with its
side's device and threads (`generate.device`/`threads`, `train.device`/`threads`); its stages
run in it (`in_process`) or in stage processes of their own, as in lock-step. The lanes wait for
each other through the files only (the manifests of score K and train K-1-S), so which policy
samples an iteration is fixed by S, whatever the timing, the kills and the resumes. `run` holds
the one run lock for both; when a lane fails, the other is stopped and `run` fails (completed
work is kept, a re-run goes on from it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlhf_batch.config import Config
from rlhf_batch.errors import StageError
from rlhf_batch.store import fs, layout, manifests

LANES = {"sample": ("generate", "score"), "learn": ("advantage", "train", "eval")}


def use_side(cfg: Config, stage: str) -> None:
    """`stage`'s side settings (generate.device/threads or train's) as the run's, in this process:
    its CUDA devices through CUDA_VISIBLE_DEVICES, before CUDA starts."""
    cfg.device, cfg.threads, cuda = cfg.side(stage)  # type: ignore[assignment]
    if cuda is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda


def run_overlapped(cfg: Config, config_path: Path, overrides: list[str], quiet: bool) -> None:
    """The two lanes, each a process; returns when both are done, raises when one fails (the
    other is stopped first). The caller holds the run lock (LOCK_ENV tells the lanes)."""
    from rlhf_batch.runtime.procgroup import die_with

    sets = [a for o in [*overrides, f"iterations={cfg.iterations}"] for a in ("--set", o)]
    procs = {
        lane: subprocess.Popen(
            [sys.executable, "-P", "-m", "rlhf_batch", "lane", lane, str(config_path), *sets]
            + (["--quiet"] if quiet else []),
            preexec_fn=die_with(os.getpid()),
        )
        for lane in LANES
    }
    try:
        warm_up("run")  # the summary and report at the end, while the learn lane waits for score 0
        failed = _wait_all(procs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its stage processes die with it (PDEATHSIG)
                p.wait()
    if failed:
        lane, code = failed
        raise StageError(
            f"the {lane} lane failed (exit {code}); the other lane was stopped. Fix the cause and "
            "run again: completed work is kept"
        )


def _wait_all(procs: dict[str, subprocess.Popen]) -> tuple[str, int] | None:
    """Until every lane exits 0 (None) or the first one fails: (its name, its exit code)."""
    while True:
        codes = {lane: p.poll() for lane, p in procs.items()}
        for lane, code in codes.items():
            if code not in (None, 0):
                return lane, code
        if all(code == 0 for code in codes.values()):
            return None
        time.sleep(0.05)


def warm_up(lane: str) -> None:
    """The modules `lane`'s stages import, imported now: the learn lane's while it waits for score
    0 (generate 0 runs meanwhile; about 2 s of a tiny run's start-up), and `run`'s summary and
    report ("run") while the lanes work."""
    if lane not in ("learn", "run"):
        return
    import duckdb  # noqa: F401  (advantage; the report's queries)

    if lane == "learn":
        import transformers.models.auto.modeling_auto  # noqa: F401

        import rlhf_batch.stages.train.step  # noqa: F401
    else:
        import matplotlib.pyplot  # noqa: F401


def await_policy(cfg: Config, it: int) -> None:
    """Until the policy iteration `it` samples from is trained (train K-1-S complete)."""
    from rlhf_batch.core.staleness import sampling_start

    if (start := sampling_start(it, cfg.max_staleness)) > 0:
        await_folder(cfg, start - 1, layout.TRAIN)


def await_folder(cfg: Config, it: int, folder: str) -> None:
    """Until iteration `it`'s `folder` is complete (its manifest is there). The other lane makes
    it; if that lane fails, `run` stops this one."""
    sdir = layout.folder(cfg.run_dir, it, folder)
    pause = fs.store_of(sdir).poll_s
    while manifests.manifest(sdir) is None:
        time.sleep(pause)
