"""`--force` never destroys finished work: a forced stage that fails, or is killed anywhere before
its new output is complete, leaves the old output complete and readable; killed during the swap,
the next command finishes the swap (staging.py). Real `rlhf-batch` subprocesses on tiny models."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.store import layout
from tests.reliability.harness import KILLS, environment


def rb(*args: object, fault: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *map(str, args)],
        env=environment(fault),
        capture_output=True,
        text=True,
        timeout=600,
    )


def ok(*args: object) -> None:
    res = rb(*args)
    assert res.returncode == 0, res.stderr[-3000:]


def one_line_error(res: subprocess.CompletedProcess, *words: str) -> str:
    assert res.returncode == 1, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def snapshot(*dirs: Path) -> dict[str, str]:
    """sha256 of every file below `dirs` (relative name -> digest)."""
    out = {}
    for d in dirs:
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            out[f"{d.name}/{f.relative_to(d)}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def leftovers(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*.new") if p.is_dir()) + sorted(
        str(p.relative_to(run_dir)) for p in run_dir.rglob(".*.old")
    )


@pytest.fixture
def small_run(make_config, tmp_path: Path):
    """make(extra, **top) -> (config path, run dir) of a complete 2-iteration in-process run."""

    def make(extra: str = "", **top: object) -> tuple[Path, Path]:
        path, cfg = make_config(extra, iterations=2, in_process=True, threads=1, **top)
        ok("run", path, "--quiet")
        return path, Path(cfg.run_dir)

    return make


@pytest.mark.slow
def test_generate_and_eval_force_without_their_start_policy_keep_the_old_output(
    small_run, tmp_path: Path, demo_prompts: Path
) -> None:
    """keep_policies = 1 removed iteration 0's policy: forcing generate or eval of iteration 1
    (which start from it) fails before anything is written; the rows are kept and `run` goes on."""
    path, run_dir = small_run(f'[eval]\nprompts = "{demo_prompts}"\nevery = 1\n', keep_policies=1)
    it1 = layout.iter_dir(run_dir, 1)
    before = snapshot(it1 / "rollouts", it1 / "eval")
    for command in ("generate", "eval"):
        one_line_error(rb(command, path, "--iter", 1, "--force", "--quiet"), "removed by keep_policies")
    assert snapshot(it1 / "rollouts", it1 / "eval") == before
    assert leftovers(run_dir) == []
    ok("run", path, "--quiet")  # nothing lost: nothing to redo
    assert snapshot(it1 / "rollouts", it1 / "eval") == before


@pytest.mark.slow
def test_train_force_with_another_lora_shape_keeps_metrics_manifest_and_optimizer(small_run) -> None:
    path, run_dir = small_run("[lora]\nenabled = true\nr = 4\nalpha = 8\n")
    it1 = layout.iter_dir(run_dir, 1)
    before = snapshot(it1 / "train", it1 / "policy")
    one_line_error(rb("train", path, "--iter", 1, "--force", "--set", "lora.r=8"), "lora.r", "adapter")
    assert snapshot(it1 / "train", it1 / "policy") == before
    assert leftovers(run_dir) == []


# A forced re-train of iteration 0 with another lr, killed before the new output is complete
# (old output intact) and at each step of the swap (finished by the next command).
BEFORE_COMMIT = ("train:model-loaded", "train:policy:tmp", "train:manifest")
IN_SWAP = ("train:commit", "train:commit:policy", "train:commit:retired")


@pytest.mark.slow
def test_forced_train_killed_before_and_during_its_swap(make_config, tmp_path: Path) -> None:
    path, cfg = make_config(iterations=1, in_process=True, threads=1)
    run_dir = Path(cfg.run_dir)
    ok("run", path, "--quiet")
    it0 = layout.iter_dir(run_dir, 0)
    old = snapshot(it0 / "train", it0 / "policy")
    force = ("train", path, "--iter", 0, "--force", "--quiet", "--set", "train.lr=0.02")
    # the uninterrupted forced re-train, in a copy of the run
    ref_cfg = path.with_name("ref.toml")
    ref_cfg.write_text(path.read_text().replace(str(run_dir), str(tmp_path / "ref")))
    shutil.copytree(run_dir, tmp_path / "ref")
    ok("train", ref_cfg, "--iter", 0, "--force", "--quiet", "--set", "train.lr=0.02")
    ref_it0 = layout.iter_dir(tmp_path / "ref", 0)
    new_weights = snapshot(ref_it0 / "policy")
    assert new_weights != snapshot(it0 / "policy")  # the new lr trains other weights

    for point in BEFORE_COMMIT:
        res = rb(*force, fault=point)
        assert res.returncode == -signal.SIGKILL, f"{point}: not reached\n{res.stderr[-2000:]}"
        KILLS["named"] += 1
        assert snapshot(it0 / "train", it0 / "policy") == old, point  # untouched
    # each kill in the swap is of a forced train to the lr not in place: the new, the old, the new
    lr = {"new": ("--set", "train.lr=0.02"), "old": ()}
    weights = {"new": new_weights, "old": old_policy(old)}
    for point, target in zip(IN_SWAP, ("new", "old", "new"), strict=True):
        res = rb("train", path, "--iter", 0, "--force", "--quiet", *lr[target], fault=point)
        assert res.returncode == -signal.SIGKILL, f"{point}: not reached\n{res.stderr[-2000:]}"
        KILLS["named"] += 1
        # the next command that writes the run finishes the swap: here train with that lr, which
        # then finds its stage complete
        ok("train", path, "--iter", 0, "--quiet", *lr[target])
        assert snapshot(it0 / "policy") == weights[target], point
        assert leftovers(run_dir) == [], point
    assert _key(it0) == _key(ref_it0)
    ok("train", path, "--iter", 0, "--force", "--quiet")  # uninterrupted, back to the old lr
    assert snapshot(it0 / "policy") == old_policy(old)


def old_policy(snap: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in snap.items() if k.startswith("policy/")}


def _manifest(sdir: Path) -> dict:
    return json.loads((sdir / layout.MANIFEST).read_text())


def _key(it_dir: Path) -> str:
    return _manifest(it_dir / "train")["key"]


@pytest.mark.slow
def test_forced_generate_killed_in_its_swap_is_finished_by_run(make_config) -> None:
    """generate --force with another temperature, killed after the old rollouts are renamed away and
    before the new ones are in place: `run` puts the new ones in place (none lost) and goes on."""
    path, cfg = make_config(iterations=1, in_process=True, threads=1)
    run_dir = Path(cfg.run_dir)
    ok("run", path, "--quiet")
    rollouts = layout.folder(run_dir, 0, "rollouts")
    force = ("generate", path, "--force", "--quiet", "--set", "generate.temperature=0.7")
    res = rb(*force, fault="rollouts:commit:retired")
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    KILLS["named"] += 1
    assert not rollouts.exists()  # mid-swap: the old folder renamed away, the new one not yet in place
    one_line_error(rb("run", path, "--quiet"), "different config", "temperature")  # swapped in: the new rows
    assert leftovers(run_dir) == []
    assert _manifest(rollouts)["config"]["generate"]["temperature"] == 0.7
    assert _manifest(rollouts)["rows"] == 12 * 4


@pytest.mark.slow
def test_score_force_with_the_same_config_keeps_the_folder_so_run_goes_on(make_config) -> None:
    """Advantage fingerprints the scores manifest's bytes: a forced re-score that wrote the same
    parts keeps the old folder (manifest included), and `run` goes on without refusing."""
    path, cfg = make_config(iterations=1, in_process=True, threads=1)
    run_dir = Path(cfg.run_dir)
    ok("run", path, "--quiet")
    scores = layout.folder(run_dir, 0, "scores")
    before = snapshot(scores)
    ok("score", path, "--iter", 0, "--force", "--quiet")
    assert snapshot(scores) == before and leftovers(run_dir) == []
    ok("run", path, "--quiet")
    # a forced re-score that changes the rows still replaces them
    ok("score", path, "--iter", 0, "--force", "--quiet", "--set", "score.kl_reward_coef=0.5")
    assert _manifest(scores)["config"]["score"]["kl_reward_coef"] == 0.5


@pytest.mark.slow
def test_run_removes_killed_forced_stages_and_a_swap_killed_before_the_old_folder_is_removed(
    make_config,
) -> None:
    """A forced generate killed mid-part and a forced train killed while writing its policy leave
    `.rollouts.new` and `.train.new/.policy.PID.tmp`: the next `run` removes both (it never
    resumes a forced stage). A forced generate killed after the new folder is renamed into place
    and before the old one is removed: the next command removes the old one, keeping the new."""
    path, cfg = make_config(iterations=1, in_process=True, threads=1)
    run_dir = Path(cfg.run_dir)
    ok("run", path, "--quiet")
    it0 = layout.iter_dir(run_dir, 0)
    res = rb(
        "generate",
        path,
        "--force",
        "--quiet",
        "--set",
        "generate.temperature=0.7",
        fault="rollouts:part-1:tmp",
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    res = rb(
        "train", path, "--iter", 0, "--force", "--quiet", "--set", "train.lr=0.02", fault="dir:policy:tmp"
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    KILLS["named"] += 2
    assert (it0 / ".rollouts.new").is_dir() and layout.leftovers(it0 / ".train.new", "policy")
    before = snapshot(it0 / "rollouts", it0 / "train", it0 / "policy")
    ok("run", path, "--quiet")
    assert leftovers(run_dir) == [] and not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
    assert snapshot(it0 / "rollouts", it0 / "train", it0 / "policy") == before
    force = ("generate", path, "--force", "--quiet", "--set", "generate.temperature=0.7")
    res = rb(*force, fault="rollouts:commit:swapped")
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    KILLS["named"] += 1
    assert (it0 / "rollouts").is_dir() and (it0 / ".rollouts.old").is_dir()  # the window
    ok("generate", path, "--quiet", "--set", "generate.temperature=0.7")  # finds its stage complete
    assert leftovers(run_dir) == []
    assert _manifest(it0 / "rollouts")["config"]["generate"]["temperature"] == 0.7
