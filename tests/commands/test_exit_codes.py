"""Exit codes are honest: 130 on Ctrl-C, non-zero whenever a stage did not complete, also when
user code (a reward function) calls sys.exit(0) or raises KeyboardInterrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REWARDS = """
import os, sys, time
from pathlib import Path

def exits(responses, **_):
    sys.exit(0)

def interrupts(responses, **_):
    raise KeyboardInterrupt

def leaves_work(responses, **_):
    import atexit, threading

    mark = os.environ["MARK"]
    atexit.register(lambda: Path(mark + ".atexit").write_text("ran"))

    def later():
        time.sleep(0.5)
        Path(mark + ".thread").write_text("joined")

    threading.Thread(target=later).start()  # not a daemon: a normal exit waits for it
    print("a line left in the buffer", end="")
    return [0.0] * len(responses)

def waits(responses, **_):
    Path(os.environ["MARK"]).touch()
    time.sleep(120)
    return [0.0] * len(responses)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    (tmp_path / "exit_rewards.py").write_text(REWARDS)
    return {**os.environ, "PYTHONPATH": str(tmp_path), **extra}


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *args], capture_output=True, text=True, env=env, timeout=300
    )


def _generated(make_config, reward: str) -> tuple[Path, Path]:
    from typer.testing import CliRunner

    from rlhf_batch.commands.cli import app

    path, cfg = make_config(score={"reward_functions": [f"exit_rewards:{reward}"]})
    res = CliRunner().invoke(app, ["generate", str(path), "--quiet"])
    assert res.exit_code == 0, res.output
    return path, Path(cfg.run_dir) / "iter=0000" / "scores"


def test_a_reward_function_calling_sys_exit_0_fails_the_stage(make_config, tmp_path: Path) -> None:
    path, scores = _generated(make_config, "exits")
    res = _cli(["score", str(path), "--quiet"], _env(tmp_path))
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == "error: reward function exit_rewards:exits called sys.exit(0)"
    assert not (scores / "_manifest.json").exists()


def test_a_finished_command_exits_as_python_does_without_the_teardown(make_config, tmp_path: Path) -> None:
    """cli.exit_now skips module teardown only: a thread user code started is joined, its atexit
    handlers run, buffered output is written, and the code is the command's."""
    path, scores = _generated(make_config, "leaves_work")
    mark = tmp_path / "mark"
    res = _cli(["score", str(path), "--quiet"], _env(tmp_path, MARK=str(mark)))
    assert res.returncode == 0, res.stderr
    assert (scores / "_manifest.json").exists()
    assert Path(f"{mark}.atexit").read_text() == "ran"
    assert Path(f"{mark}.thread").read_text() == "joined"
    assert "a line left in the buffer" in res.stdout


def test_keyboard_interrupt_in_a_stage_exits_130(make_config, tmp_path: Path) -> None:
    path, scores = _generated(make_config, "interrupts")
    for args in (["score", str(path)], ["run", str(path), "--in-process"]):
        res = _cli([*args, "--quiet"], _env(tmp_path))
        assert res.returncode == 130, (args, res.returncode, res.stderr[-2000:])
        assert not (scores / "_manifest.json").exists()


def test_sigint_exits_130(make_config, tmp_path: Path) -> None:
    """A real Ctrl-C (SIGINT to the process) while a reward function runs."""
    path, scores = _generated(make_config, "waits")
    mark = tmp_path / "reward-started"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_batch", "score", str(path), "--quiet"],
        env=_env(tmp_path, MARK=str(mark)),
        stderr=subprocess.PIPE,
        text=True,
        # as a command in the foreground of a terminal: a shell runs a background job (`make test &`)
        # with SIGINT ignored, and a child inherits that (Python then installs no handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mark.exists(), proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert not (scores / "_manifest.json").exists()


def test_export_refuses_a_min_reward_that_is_not_finite(make_config, tmp_path: Path) -> None:
    """nan compares false with every score: it would keep every row instead of filtering."""
    path, _ = make_config()
    res = _cli(["export", str(path), "--out", str(tmp_path / "ds"), "--min-reward", "nan"], dict(os.environ))
    assert (
        res.returncode == 1 and res.stderr.strip() == "error: --min-reward: must be a finite number, got nan"
    )
    assert not (tmp_path / "ds").exists()
