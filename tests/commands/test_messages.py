"""What the commands print: one true line, never an option the command lacks."""

import subprocess
import sys
from pathlib import Path

from rlhf_batch.stages import generate


def rlhf(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *map(str, args)], capture_output=True, text=True, timeout=600
    )


def test_a_refused_stage_in_run_names_the_stage_command_with_force(make_config, demo_prompts: Path) -> None:
    path, cfg = make_config()
    generate.run(cfg, 0, quiet=True)
    data = Path(cfg.generate.prompts)
    edited = data.parent / "edited.jsonl"
    edited.write_text(data.read_text() + data.read_text().splitlines()[0].replace("demo-000000", "x") + "\n")
    res = rlhf(
        "run", path, "--iterations", "1", "--in-process", "--quiet", "--set", f"generate.prompts={edited}"
    )
    assert res.returncode == 1
    (line,) = res.stderr.strip().splitlines()
    assert "replace it with `rlhf-batch generate CONFIG --iter 0 --force`" in line, line
    assert "re-run it with --force" not in line
