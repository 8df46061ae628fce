"""`generate.python` (vLLM's own venv) is honoured by every command that samples: `generate` and
`eval` hand themselves over to that interpreter, `run` and `topup` start their generate (and
eval) stages in it. The interpreter here is a stand-in: a script that records its arguments, then
runs this venv's Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stages.cli_helpers import cli, manifest, stage

STAND_IN = """#!/bin/sh
echo "$*" >> "{log}"
exec "{python}" "$@"
"""


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    log, python = tmp_path / "python.log", tmp_path / "venv-python"
    python.write_text(STAND_IN.format(log=log, python=sys.executable))
    python.chmod(0o755)
    return python, log


def rb(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_generate_and_eval_run_in_generate_python(make_config, demo_prompts: Path, tmp_path: Path) -> None:
    python, log = stand_in(tmp_path)
    path, cfg = make_config(
        threads=1, generate={"python": str(python)}, eval={"prompts": str(demo_prompts), "n": 2, "k": [1]}
    )
    res = rb("generate", path, "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    res = rb("eval", path, "--quiet", "--rank", "0", "--world-size", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    # each command became the same command in the stand-in, its options kept
    assert log.read_text().splitlines() == [
        f"-P -m rlhf_batch generate {path} --iter 0 --quiet",
        f"-P -m rlhf_batch eval {path} --iter 0 --rank 0 --world-size 1 --quiet",
    ]
    assert manifest(cfg.run_dir, "rollouts")["rows"] == 48 and manifest(cfg.run_dir, "eval")["rows"] == 24


def test_a_generate_python_that_is_not_an_interpreter_is_one_line(make_config, tmp_path: Path) -> None:
    path, cfg = make_config(generate={"python": str(tmp_path / "nowhere" / "python")})
    res = cli("generate", path, "--quiet")
    assert res.exit_code == 1  # type: ignore[attr-defined]
    assert "generate.python" in str(res.exception) and "not an executable interpreter" in str(res.exception)  # type: ignore[attr-defined]
    assert not Path(cfg.run_dir).exists()


@pytest.mark.slow
def test_topup_starts_its_generate_rounds_in_generate_python(make_config, tmp_path: Path) -> None:
    python, log = stand_in(tmp_path)
    # min_groups above the 12 groups there are: one top-up round, whatever the rewards
    path, cfg = make_config(
        threads=1, generate={"python": str(python)}, advantage={"min_groups": 100, "max_topup_rounds": 1}
    )
    stage(path, "generate", f"generate.python={sys.executable}")  # iteration 0 itself, here
    stage(path, "score")
    res = rb("topup", path, "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    assert log.read_text().splitlines() == [f"-P -m rlhf_batch generate {path} --iter 0 --topup 1 --quiet"]
    assert manifest(cfg.run_dir, "topup=01/rollouts")["rows"] == 48
