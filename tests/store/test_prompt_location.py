"""Prompt sets and models are identified by their content, not their paths: fan-out ranks on
machines whose copies of the prompts or of the model lie at different paths agree (started one
after the other or together), and a single-process run keeps its complete stages when the
prompts move with their content unchanged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.config import load_config
from rlhf_batch.models.tiny import init_model
from rlhf_batch.stages.executor import is_done
from rlhf_batch.stages.registry import get
from rlhf_batch.store import layout, manifests
from tests.stages.cli_helpers import cli, manifest, stage


def copy_to(demo_prompts: Path, where: Path) -> Path:
    where.mkdir(parents=True)
    return Path(shutil.copy(demo_prompts, where / "prompts.jsonl"))


def generate(config: Path, *extra: object) -> object:
    return cli("generate", config, "--quiet", *extra)


def test_ranks_with_the_same_prompts_at_other_paths_one_after_the_other(
    make_config, demo_prompts: Path, tmp_path: Path
) -> None:
    a, cfg = make_config(name="a.toml", generate={"prompts": str(copy_to(demo_prompts, tmp_path / "m0"))})
    b, _ = make_config(name="b.toml", generate={"prompts": str(copy_to(demo_prompts, tmp_path / "m1"))})
    assert generate(a, "--rank", 0, "--world-size", 2).exit_code == 0  # type: ignore[attr-defined]
    res = generate(b, "--rank", 1, "--world-size", 2)  # the other machine, later: commits
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48
    # either config finds it complete, as `run` would
    assert is_done(get("generate")(cfg, 0))
    stage(b, "generate")


def test_another_content_at_another_path_is_still_refused(
    make_config, demo_prompts: Path, tmp_path: Path
) -> None:
    a, cfg = make_config(name="a.toml", generate={"prompts": str(copy_to(demo_prompts, tmp_path / "m0"))})
    other = copy_to(demo_prompts, tmp_path / "m1")
    other.write_text("\n".join(other.read_text().splitlines()[:-1]) + "\n")  # one prompt fewer
    b, _ = make_config(name="b.toml", generate={"prompts": str(other)})
    assert generate(a, "--rank", 0, "--world-size", 2).exit_code == 0  # type: ignore[attr-defined]
    res = generate(b, "--rank", 1, "--world-size", 2)
    assert res.exit_code == 1 and "a partial run with a different config or inputs" in str(res.exception)  # type: ignore[attr-defined]
    assert "inputs.prompts" in str(res.exception)  # type: ignore[attr-defined]


def test_a_complete_run_stays_complete_when_its_prompts_move(
    make_config, demo_prompts: Path, tmp_path: Path
) -> None:
    here = copy_to(demo_prompts, tmp_path / "before")
    path, cfg = make_config(generate={"prompts": str(here)})
    stage(path, "generate")
    sdir = layout.folder(cfg.run_dir, 0, layout.ROLLOUTS)
    before = (sdir / layout.MANIFEST).read_text()
    moved = copy_to(demo_prompts, tmp_path / "after")
    here.unlink()
    path, cfg = make_config(generate={"prompts": str(moved)})
    assert is_done(get("generate")(cfg, 0))
    stage(path, "generate")
    assert (sdir / layout.MANIFEST).read_text() == before


def test_ranks_with_the_same_model_at_other_paths_agree_another_model_is_refused(
    make_config, tiny_model: Path, tmp_path: Path
) -> None:
    a, cfg = make_config(name="a.toml", policy_model=str(shutil.copytree(tiny_model, tmp_path / "m0")))
    b, _ = make_config(name="b.toml", policy_model=str(shutil.copytree(tiny_model, tmp_path / "m1")))
    assert generate(a, "--rank", 0, "--world-size", 2).exit_code == 0  # type: ignore[attr-defined]
    res = generate(b, "--rank", 1, "--world-size", 2)  # the other machine, later: commits
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48
    assert is_done(get("generate")(load_config(b), 0))  # `run` on either machine finds it complete
    # the same config and sizes, other weights (another seed): refused, whatever its path
    other = init_model(tmp_path / "m2", arch="qwen2", seed=1)
    run2 = str(tmp_path / "run2")
    c, _ = make_config(
        name="c.toml", run_dir=run2, policy_model=str(shutil.copytree(tiny_model, tmp_path / "m3"))
    )
    d, _ = make_config(name="d.toml", run_dir=run2, policy_model=str(other))
    assert generate(c, "--rank", 0, "--world-size", 2).exit_code == 0  # type: ignore[attr-defined]
    res = generate(d, "--rank", 1, "--world-size", 2)
    assert res.exit_code == 1 and "a partial run with a different config or inputs" in str(res.exception)  # type: ignore[attr-defined]
    assert "inputs.policy.sha256" in str(res.exception)  # type: ignore[attr-defined]


def test_a_stage_completed_before_base_models_were_hashed_stays_complete(make_config) -> None:
    """A manifest of an older version: its base model's fingerprint without `sha256`, its key
    that identity's (sha256 of the sorted JSON of config, inputs and schema_version, 16 hex)."""
    import hashlib
    import json

    path, cfg = make_config()
    stage(path, "generate")
    mpath = layout.folder(cfg.run_dir, 0, layout.ROLLOUTS) / layout.MANIFEST
    m = json.loads(mpath.read_text())
    assert len(m["inputs"]["policy"]["sha256"]) == 16
    del m["inputs"]["policy"]["sha256"]
    old = {k: m[k] for k in ("config", "inputs", "schema_version")}
    m["key"] = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()[:16]
    mpath.write_text(json.dumps(m))
    assert is_done(get("generate")(cfg, 0))
    m["inputs"]["policy"]["weights"] = {"model.safetensors": 1}  # another model: not complete
    m["key"] = hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()[:16]
    mpath.write_text(json.dumps(m))
    assert not is_done(get("generate")(cfg, 0))


@pytest.mark.slow
def test_ranks_with_the_same_prompts_at_other_paths_started_together(
    make_config, demo_prompts: Path, tmp_path: Path
) -> None:
    configs = [
        make_config(
            name=f"m{r}.toml", threads=1, generate={"prompts": str(copy_to(demo_prompts, tmp_path / f"m{r}"))}
        )
        for r in range(2)
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlhf_batch",
                "generate",
                str(c),
                "--quiet",
                "--rank",
                str(r),
                "--world-size",
                "2",
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, (c, _) in enumerate(configs)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    m = manifests.manifest(layout.folder(configs[0][1].run_dir, 0, layout.ROLLOUTS))
    assert m is not None and m["rows"] == 48
