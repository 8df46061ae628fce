"""`--force` on an object store never deletes first: the new output is staged beside the old
one (`.<folder>.new/`) and copied over it only once its manifest exists (store/staging.py). A
forced stage that fails, or is killed anywhere before that, leaves the old output complete and
byte for byte as it was; killed in the swap, the next command finishes it. A real S3-protocol
server (moto, tests/s3server.py) and real `rlhf-batch` subprocesses."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest

from rlhf_batch.store import layout
from rlhf_batch.store.fs import filesystem, key, run_path
from tests.observe.test_tracking import write_config
from tests.s3server import new_bucket
from tests.store.test_s3_reliability import rlhf


def objects(prefix: Path) -> dict[str, str]:
    """sha256 of every object below `prefix` (relative name -> digest)."""
    fsys, root = filesystem(prefix), key(prefix).rstrip("/")
    return {k[len(root) + 1 :]: hashlib.sha256(fsys.cat_file(k)).hexdigest() for k in fsys.find(root)}


def staged_left(run_dir: str) -> list[str]:
    root = run_path(run_dir)
    fsys, base = filesystem(root), key(root).rstrip("/")
    return sorted({k[len(base) + 1 :].split("/")[1] for k in fsys.find(base) if "/." in k and ".new" in k})


@pytest.fixture
def s3_done(s3_server, tiny_model: Path, demo_prompts: Path, tmp_path: Path, monkeypatch):
    """(config path, run_dir, env) of a complete one-iteration run on the store."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    run_dir = f"s3://{new_bucket(s3_server)}/run"
    path = write_config(
        tmp_path / "c.toml", tiny_model, demo_prompts, run_dir=run_dir, iterations=1, in_process=True
    )
    env = {**os.environ, **s3_server.env(), "RLHF_BATCH_LOCK_STALE_S": "1"}
    done = rlhf("run", str(path), "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    return path, run_dir, env


def killed(res, point: str = "") -> None:
    assert res.returncode == -signal.SIGKILL, f"{point}: {res.stderr[-2000:]}"


@pytest.mark.slow
def test_a_forced_generate_that_fails_or_is_killed_keeps_the_old_rollouts(s3_done, tmp_path: Path) -> None:
    path, run_dir, env = s3_done
    it0 = run_path(run_dir) / "iter=0000"
    old = objects(it0 / "rollouts")
    assert len([n for n in old if n.startswith("part-")]) >= 3
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"prompt": "a"}\n{not json\n')
    res = rlhf("generate", str(path), "--force", "--quiet", "--set", f"generate.prompts={corrupt}", env=env)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr[-2000:]
    assert objects(it0 / "rollouts") == old  # manifest and parts kept
    # killed before the new output is complete: the old one untouched
    force = ("generate", str(path), "--force", "--quiet")
    for point in ("rollouts:part-1:tmp", "rollouts:manifest"):
        killed(rlhf(*force, "--set", "generate.temperature=0.7", env={**env, "RLHF_BATCH_FAULT": point}))
        assert objects(it0 / "rollouts") == old, point
    # killed in each window of the swap: the first kill lands in the forced command's swap, each
    # next one in the same swap being finished by the next command; a complete output is always
    # there, the old or the staged one
    for point in ("rollouts:commit", "rollouts:commit:retired", "rollouts:commit:swapped"):
        killed(rlhf(*force, "--set", "generate.temperature=0.7", env={**env, "RLHF_BATCH_FAULT": point}))
        has = objects(it0 / "rollouts")
        assert layout.MANIFEST in has or layout.MANIFEST in objects(it0 / ".rollouts.new"), point
    # `run` finishes the last swap (temperature 0.7 is in place: the run's own 1.0 differs) in one line
    res = rlhf("run", str(path), "--quiet", env=env)
    assert res.returncode == 1 and "temperature" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    m = (it0 / "rollouts" / layout.MANIFEST).read_text()
    assert '"temperature": 0.7' in m and staged_left(run_dir) == []
    assert set(objects(it0 / "rollouts")) == set(old)  # the same part names, no stale part


@pytest.mark.slow
def test_a_forced_train_killed_anywhere_keeps_or_finishes_and_never_loses_state(s3_done) -> None:
    path, run_dir, env = s3_done
    it0 = run_path(run_dir) / "iter=0000"
    old = {**objects(it0 / "train"), **{f"policy/{k}": v for k, v in objects(it0 / "policy").items()}}
    assert any("optimizer" in n for n in old) and layout.MANIFEST in old
    steps = (
        "--set",
        "train.checkpoint_every=1",
        "--set",
        "train.sequences_per_step=1",
        "--set",
        "train.ppo_epochs=3",
    )
    force = ("train", str(path), "--iter", "0", "--force", "--quiet", *steps)
    for point in ("train:checkpoint-2", "train:policy:tmp", "train:manifest"):
        killed(rlhf(*force, "--set", "train.lr=0.02", env={**env, "RLHF_BATCH_FAULT": point}))
        now = {**objects(it0 / "train"), **{f"policy/{k}": v for k, v in objects(it0 / "policy").items()}}
        assert now == old, point  # manifest, metrics, optimizer state and policy as they were
    # the swap killed in each window (first in the forced command, then each time in the next
    # command finishing it): a complete train output is always there, the old or the staged one
    for point in ("train:commit", "train:commit:policy", "train:commit:retired", "train:commit:swapped"):
        killed(rlhf(*force, "--set", "train.lr=0.02", env={**env, "RLHF_BATCH_FAULT": point}))
        has = objects(it0 / "train")
        assert layout.MANIFEST in has or layout.MANIFEST in objects(it0 / ".train.new"), point
    # the next command finishes the swap: train with lr 0.02 then finds its stage complete
    res = rlhf("train", str(path), "--iter", "0", "--quiet", *steps, "--set", "train.lr=0.02", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    m = (it0 / "train" / layout.MANIFEST).read_text()
    assert '"lr": 0.02' in m and staged_left(run_dir) == []
    new = objects(it0 / "policy")
    assert new and new != {k[len("policy/") :]: v for k, v in old.items() if k.startswith("policy/")}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "folder", "change", "recorded"),
    [
        ("score", "scores", "score.kl_reward_coef=0.2", '"kl_reward_coef": 0.2'),
        ("advantage", "advantages", "advantage.ddof=0", '"ddof": 0'),
    ],
)
def test_forced_score_and_advantage_killed_anywhere_keep_or_finish_their_output(
    s3_done, command: str, folder: str, change: str, recorded: str
) -> None:
    path, run_dir, env = s3_done
    it0 = run_path(run_dir) / "iter=0000"
    old = objects(it0 / folder)
    assert layout.MANIFEST in old
    force = (command, str(path), "--iter", "0", "--force", "--quiet", "--set", change)
    # killed before the new output is complete: the old one byte for byte as it was
    for point in (f"{folder}:part-0:tmp", f"{folder}:manifest"):
        killed(rlhf(*force, env={**env, "RLHF_BATCH_FAULT": point}), point)
        assert objects(it0 / folder) == old, point
    # killed in each window of the swap: the first kill lands in the forced command's swap, each
    # next one in the same swap being finished by the next command; a complete output is always
    # there, the old or the staged one
    for point in (f"{folder}:commit", f"{folder}:commit:retired", f"{folder}:commit:swapped"):
        killed(rlhf(*force, env={**env, "RLHF_BATCH_FAULT": point}), point)
        has = objects(it0 / folder)
        assert layout.MANIFEST in has or layout.MANIFEST in objects(it0 / f".{folder}.new"), point
    # the next command finishes the swap and then finds the stage complete with the new setting
    res = rlhf(command, str(path), "--iter", "0", "--quiet", "--set", change, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert recorded in (it0 / folder / layout.MANIFEST).read_text() and staged_left(run_dir) == []


@pytest.fixture
def s3_eval(s3_server, tiny_model: Path, demo_prompts: Path, tmp_path: Path, monkeypatch):
    """(config path, run_dir, env) of a run on the store holding only iteration 0's eval: 4
    held-out prompts, 2 samples each, 2 parts (the base model is iteration 0's policy)."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(f"{line}\n" for line in demo_prompts.read_text().splitlines()[:4]))
    run_dir = f"s3://{new_bucket(s3_server)}/run"
    ev = {"prompts": str(held), "n": 2, "prompts_per_part": 2}
    path = write_config(tmp_path / "c.toml", tiny_model, held, run_dir=run_dir, eval=ev)
    env = {**os.environ, **s3_server.env(), "RLHF_BATCH_LOCK_STALE_S": "1"}
    done = rlhf("eval", str(path), "--iter", "0", "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    return path, run_dir, env


@pytest.mark.slow
def test_a_forced_eval_killed_anywhere_keeps_or_finishes_and_is_always_readable(s3_eval) -> None:
    from rlhf_batch.store import manifests, schemas

    path, run_dir, env = s3_eval
    it0 = run_path(run_dir) / "iter=0000"
    old = objects(it0 / "eval")
    assert layout.MANIFEST in old and len([n for n in old if n.startswith("part-")]) == 2
    force = ("eval", str(path), "--iter", "0", "--force", "--quiet", "--set", "eval.temperature=0.7")
    for point in ("eval:part-1:tmp", "eval:manifest"):  # before the commit: the old output as it was
        killed(rlhf(*force, env={**env, "RLHF_BATCH_FAULT": point}), point)
        assert objects(it0 / "eval") == old, point
    # killed after the staged manifest (the commit) but before the copy: the folder has no
    # manifest of its own, and a reader reads the committed output from its staged copy
    killed(rlhf(*force, env={**env, "RLHF_BATCH_FAULT": "eval:commit:retired"}))
    assert layout.MANIFEST not in objects(it0 / "eval")
    staged = (it0 / ".eval.new" / layout.MANIFEST).read_text()
    assert manifests.manifest(it0 / "eval") is not None and '"temperature": 0.7' in staged
    assert manifests.read_complete(it0 / "eval", schemas.EVAL).num_rows == 8  # 4 prompts x 2
    sql = rlhf("sql", "SELECT count(*) AS n FROM eval", "--run-dir", run_dir, "--format", "csv", env=env)
    assert sql.returncode == 0 and sql.stdout.split() == ["n", "8"], sql.stderr[-2000:]
    status = rlhf("status", run_dir, env=env)
    assert status.returncode == 0 and "partial" not in status.stdout, status.stdout
    # the next kills land in the same swap being finished by the next command
    for point in ("eval:commit", "eval:commit:swapped"):
        killed(rlhf(*force, env={**env, "RLHF_BATCH_FAULT": point}), point)
        assert manifests.manifest(it0 / "eval") is not None, point
    res = rlhf("eval", str(path), "--iter", "0", "--quiet", "--set", "eval.temperature=0.7", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"temperature": 0.7' in (it0 / "eval" / layout.MANIFEST).read_text()
    assert staged_left(run_dir) == [] and set(objects(it0 / "eval")) == set(old)


@pytest.mark.slow
def test_a_forced_import_killed_anywhere_keeps_or_finishes_its_rollouts(
    s3_server, tiny_model: Path, demo_prompts: Path, tmp_path: Path, monkeypatch
) -> None:
    import json

    from rlhf_batch.store import manifests

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    run_dir = f"s3://{new_bucket(s3_server)}/run"
    path = write_config(
        tmp_path / "c.toml", tiny_model, demo_prompts, run_dir=run_dir, score={"rows_per_part": 2}
    )
    rows = [
        {"prompt": p, "response": r}
        for p, r in (("a*2=", "aa"), ("b*1=", "b"), ("c*2=", "cx"), ("a*1=", "a"))
    ]
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows))
    second.write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    env = {**os.environ, **s3_server.env(), "RLHF_BATCH_LOCK_STALE_S": "1"}
    assert rlhf("import", str(first), "--config", str(path), "--quiet", env=env).returncode == 0
    it0 = run_path(run_dir) / "iter=0000"
    old = objects(it0 / "rollouts")
    assert len([n for n in old if n.startswith("part-")]) == 2
    force = ("import", str(second), "--config", str(path), "--force", "--quiet")
    for point in ("rollouts:part-1:tmp", "rollouts:manifest"):  # before the commit: as it was
        killed(rlhf(*force, env={**env, "RLHF_BATCH_FAULT": point}), point)
        assert objects(it0 / "rollouts") == old, point
    for point in ("rollouts:commit:retired", "rollouts:commit:swapped"):  # in the swap: readable
        killed(rlhf(*force, env={**env, "RLHF_BATCH_FAULT": point}), point)
        assert manifests.manifest(it0 / "rollouts") is not None, point
    res = rlhf(*force[:-2], "--quiet", env=env)  # the same file again: the swap finished, complete
    assert res.returncode == 0, res.stderr[-2000:]
    assert staged_left(run_dir) == [] and str(second) in (it0 / "rollouts" / layout.MANIFEST).read_text()
