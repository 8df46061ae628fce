"""`make test` (RLHF_BATCH_STRICT_SKIPS=1) fails on a skip whose reason is not on the allow-list
of tests/conftest.py: a test that can never run (a venv path computed wrong) is a defect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import pytest

def test_runs():
    assert True

def test_machine_without_a_gpu():
    pytest.skip("no CUDA GPU on this machine")
"""


def pytest_in(tmp_path: Path, extra: str, strict: bool, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(TESTS + extra)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RLHF_BATCH_STRICT_SKIPS", None)
    if strict:
        env["RLHF_BATCH_STRICT_SKIPS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    return subprocess.run([*cmd, *args, str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path)


@pytest.mark.slow
def test_an_allowed_skip_passes_and_any_other_fails_the_strict_session(tmp_path: Path) -> None:
    assert pytest_in(tmp_path, "", strict=True).returncode == 0
    wrong = """
def test_needs_a_venv():
    pytest.skip("trackio is not installed: run `make trackio`")
"""
    res = pytest_in(tmp_path, wrong, strict=True)
    assert res.returncode == 1, res.stdout
    assert "test_needs_a_venv: trackio is not installed" in res.stdout
    assert "no CUDA GPU" not in res.stdout.split("not on the allow-list")[1]  # the allowed one is not listed
    assert pytest_in(tmp_path, wrong, strict=False).returncode == 0  # a plain pytest run only reports it
    module = 'pytest.skip("whole module", allow_module_level=True)\n'
    res = pytest_in(tmp_path, module, strict=True)
    assert res.returncode == 1 and "whole module" in res.stdout, res.stdout


@pytest.mark.slow
def test_the_strict_session_sees_the_skips_of_xdist_workers(tmp_path: Path) -> None:
    """Under `-n 2` (pytest-xdist) tests and collection run in worker processes; their skips reach
    the controller's hooks, so the allow-list still fails the session."""
    xdist = ("-n", "2", "--dist", "loadfile")
    assert pytest_in(tmp_path, "", True, *xdist).returncode == 0
    (tmp_path / "test_module.py").write_text(
        'import pytest\npytest.skip("whole module", allow_module_level=True)\n'
    )
    wrong = 'def test_needs_a_venv():\n    pytest.skip("trackio is not installed")\n'
    res = pytest_in(tmp_path, wrong, True, *xdist)
    assert res.returncode == 1, res.stdout
    assert "2 skip(s) not on the allow-list" in res.stdout, res.stdout
    assert "test_needs_a_venv: trackio is not installed" in res.stdout and "whole module" in res.stdout
