"""Helpers of the reliability suite: the shortened demo pipeline as a real `rlhf-batch run`
subprocess, kills, and the comparison of a run directory with an uninterrupted reference run."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from rlhf_batch.runtime import faults
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ADVANTAGES, METRICS, ROLLOUTS, SCORES

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "pipelines" / "demo.toml"
ITERATIONS = 2
STAGE_DIRS = (("rollouts", ROLLOUTS), ("scores", SCORES), ("advantages", ADVANTAGES))
KILLS: dict[str, int] = {"named": 0, "timed": 0}  # SIGKILLs survived in this session, printed at the end
WALL: dict[str, float] = {}  # seconds the uninterrupted reference run took on this machine, now


@dataclass(frozen=True)
class Assets:
    """What every run of the suite shares: 48 demo prompts and the tiny initial policy."""

    prompts: Path
    policy: Path


# the training the reliability tests were written against (4 steps an iteration, a checkpoint
# after step 2), whatever the demo's own settings are
TRAIN = {
    "lr": 5e-3,
    "lr_schedule": "constant",
    "total_steps": 0,
    "ppo_epochs": 2,
    "eps_low": 0.1,
    "entropy_coef": 0.0,
    "tokens_per_step": 512,
    "sequences_per_step": 0,  # steps cut by tokens
    "checkpoint_every": 2,
}


def overrides(assets: Assets, run_dir: Path, iterations: int = ITERATIONS) -> list[str]:
    """pipelines/demo.toml shortened: 48 prompts x 8 samples, 3 rollouts parts and 3 scores parts,
    4 advantage parts, 4 train steps with a checkpoint after step 2, `iterations` iterations."""
    sets = [
        f"run_dir={run_dir}",
        f"policy_model={assets.policy}",
        f"generate.prompts={assets.prompts}",
        f"iterations={iterations}",
        "threads=1",
        "generate.prompts_per_iteration=0",  # all 48 prompts every iteration
        "generate.prompts_per_part=16",
        "score.rows_per_part=128",
        "advantage.rows_per_part=32",
        *(f"train.{k}={v}" for k, v in TRAIN.items()),
    ]
    return [a for s in sets for a in ("--set", s)]


def command(assets: Assets, run_dir: Path, *extra: str, iterations: int = ITERATIONS) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlhf_batch",
        "run",
        str(DEMO),
        "--quiet",
        *overrides(assets, run_dir, iterations),
        *extra,
    ]


def environment(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != faults.FAULT_ENV}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env[faults.FAULT_ENV] = fault
    return env


def run(
    assets: Assets,
    run_dir: Path,
    *extra: str,
    fault: str | None = None,
    iterations: int = ITERATIONS,
    preexec: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """`rlhf-batch run` on the shortened demo; SIGKILLed at fault point `fault` if it reaches it."""
    return subprocess.run(
        command(assets, run_dir, *extra, iterations=iterations),
        env=environment(fault),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=preexec,
    )


def run_killed_at(
    assets: Assets, run_dir: Path, fault: str, *extra: str, iterations: int = ITERATIONS
) -> None:
    """A run that must die by SIGKILL at `fault`: a point it never reaches fails the test."""
    res = run(assets, run_dir, *extra, fault=fault, iterations=iterations)
    assert res.returncode == -signal.SIGKILL, (
        f"{fault}: not reached (exit {res.returncode})\n{res.stderr[-2000:]}"
    )
    KILLS["named"] += 1


def run_to_completion(assets: Assets, run_dir: Path, *extra: str, iterations: int = ITERATIONS) -> float:
    """An uninterrupted run; the seconds it took."""
    start = time.monotonic()
    res = run(assets, run_dir, *extra, iterations=iterations)
    assert res.returncode == 0, res.stderr[-3000:]
    return time.monotonic() - start


def kill_after(cmd: list[str], seconds: float) -> int:
    """Start `cmd`, SIGKILL it (the process only, not its children) after `seconds`; its exit code
    (-9 when the kill landed, 0 when it finished first)."""
    proc = subprocess.Popen(
        cmd, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode in (0, -signal.SIGKILL), err[-3000:]
    if proc.returncode == -signal.SIGKILL:
        KILLS["timed"] += 1
    return proc.returncode


def state(pid: int) -> str | None:
    """Process `pid`'s state letter (R, S, T: stopped, Z: a zombie, ...), None when gone: Linux /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` runs (not gone, not a zombie waiting to be reaped)."""
    return state(pid) not in (None, "Z")


def children(pid: int) -> list[int]:
    """The pids of process `pid`'s children (Linux /proc)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_for(predicate: Callable[[], bool], timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out waiting"
        time.sleep(0.02)


def read(run_dir: Path, it: int, stage: str, schema: pa.Schema) -> pa.Table:
    return manifests.read_complete(layout.folder(run_dir, it, stage), schema)


def _normalised_rollouts(run_dir: Path, it: int) -> pa.Table:
    """Rollouts with the run directory in the `policy` column (iter=K-1/policy) written as RUN."""
    t = read(run_dir, it, "rollouts", ROLLOUTS)
    policy = pc.replace_substring(t["policy"], str(run_dir), "RUN")
    return t.set_column(t.schema.get_field_index("policy"), "policy", policy)


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def assert_same_as_reference(run_dir: Path, ref_dir: Path, iterations: int = ITERATIONS) -> None:
    """Every stage complete with the rows of the uninterrupted run: the same rollout_ids (no
    duplicate, none missing), identical rollouts, rewards and advantages, the same weights (1e-6);
    no temporary file, checkpoint or half-written policy left behind."""
    for it in range(iterations):
        for stage in ("rollouts", "scores", "advantages", "train"):
            assert manifests.manifest(layout.folder(run_dir, it, stage)) is not None, f"iter {it} {stage}"
        got, want = _normalised_rollouts(run_dir, it), _normalised_rollouts(ref_dir, it)
        ids = got["rollout_id"].to_pylist()
        assert len(ids) == len(set(ids)), f"iter {it}: duplicate rollout_ids"
        assert ids == want["rollout_id"].to_pylist(), f"iter {it}: rollout_ids differ (missing or extra rows)"
        assert got.equals(want), f"iter {it}: rollouts differ"
        for stage, schema in STAGE_DIRS[1:]:
            assert read(run_dir, it, stage, schema).equals(read(ref_dir, it, stage, schema)), (
                f"iter {it}: {stage}"
            )
        metrics = [read_metrics(d, it) for d in (run_dir, ref_dir)]
        assert metrics[0].equals(metrics[1]), f"iter {it}: train metrics differ"
        if not layout.policy_dir(ref_dir, it).exists():  # removed by keep_policies: in both runs
            assert not layout.policy_dir(run_dir, it).exists(), f"iter {it}: policy kept"
            continue
        w, w_ref = weights(layout.policy_dir(run_dir, it)), weights(layout.policy_dir(ref_dir, it))
        assert w.keys() == w_ref.keys()
        for name, tensor in w.items():
            assert (tensor - w_ref[name]).abs().max().item() <= 1e-6, f"iter {it}: weight {name}"
    assert leftovers(run_dir) == []


def read_metrics(run_dir: Path, it: int) -> pa.Table:
    t = manifests.read_part(layout.folder(run_dir, it, "train") / "metrics.parquet", METRICS)
    return t.drop_columns(["tokens_per_s"])  # wall-clock speed: the one column that may differ


def leftovers(run_dir: Path) -> list[str]:
    """Temporary files and directories, checkpoints and start markers in a complete run."""
    bad = [p for p in run_dir.rglob("*") if p.name.startswith(".") and p.name != ".run.lock"]
    bad += list(run_dir.glob("iter=*/train/checkpoint")) + list(run_dir.glob("iter=*/*/_started.json"))
    return sorted(str(p.relative_to(run_dir)) for p in bad)


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file below `root` (empty when it does not exist)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
