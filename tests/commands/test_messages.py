"""What the commands print: one true line, never an option the command lacks."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_batch.stages.registry import run_stage


def rlhf(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *map(str, args)], capture_output=True, text=True, timeout=600
    )


def test_a_refused_stage_in_run_names_the_stage_command_with_force(make_config, demo_prompts: Path) -> None:
    path, cfg = make_config()
    run_stage("generate", cfg, 0, quiet=True)
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


def test_the_hub_message_claims_hf_hub_offline_only_when_it_is_set(
    tmp_path: Path, demo_prompts: Path
) -> None:
    import os

    config = tmp_path / "c.toml"
    config.write_text(f'policy_model = "nobody/no-such-model"\n[generate]\nprompts = "{demo_prompts}"\n')
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "validate", str(config)], capture_output=True, text=True, env=env
    )
    assert res.returncode == 1
    assert "the Hub cannot be reached" in res.stderr and "hf download nobody/no-such-model" in res.stderr
    assert "HF_HUB_OFFLINE is set" not in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "validate", str(config)],
        capture_output=True,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert "HF_HUB_OFFLINE is set" in res.stderr


def test_a_mistyped_local_model_path_is_not_sent_to_the_hub(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "models").mkdir()
    config = tmp_path / "c.toml"
    config.write_text('policy_model = "models/tinyy"\n')
    res = rlhf("validate", config)
    assert res.returncode == 1
    assert f"policy_model: model directory not found: {tmp_path / 'models' / 'tinyy'}" in res.stderr
    assert "hf download" not in res.stderr


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_a_resume_says_it_resumed(make_config) -> None:
    import os
    import signal
    import time

    from rlhf_batch.store import layout

    path, cfg = make_config(iterations=1, generate={"prompts_per_part": 1, "max_new_tokens": 24})
    env = {**os.environ, "RLHF_BATCH_PROGRESS_SECONDS": "0"}
    parts = layout.folder(cfg.run_dir, 0, "rollouts")
    for mode in ([], ["--in-process"]):
        before = len(layout.list_parts(parts)) if parts.is_dir() else 0
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf_batch", "run", str(path), *mode],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
            # as from a terminal: a job started in the background (`cmd &`, nohup) ignores SIGINT
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 300  # interrupted while it writes: after a part of its own
        while not (parts.is_dir() and len(layout.list_parts(parts)) > before) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
        err = proc.communicate(timeout=300)[1]
        assert proc.returncode == 130, err
        last = [line for line in err.splitlines() if line.strip()][-1]
        assert last == "interrupted: completed parts are kept; run the same command again to go on", err
        assert err.count("interrupted") == 1 and "Traceback" not in err and ": done " not in err, err
        assert "resuming" in err or mode == []  # the second run resumed the first's parts
    res = rlhf("run", path, "--in-process")
    assert res.returncode == 0, res.stderr
    assert "generate iteration 0: resuming," in res.stderr and "parts already on disk" in res.stderr
