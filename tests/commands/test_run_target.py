"""`status`, `sql` and `report` find the run from the config file or the run directory, and
refuse a directory that holds no run; `validate` checks what a run needs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app
from rlhf_batch.errors import UserError
from rlhf_batch.stages.registry import run_stage

runner = CliRunner()


@pytest.fixture
def small_run(make_config) -> tuple[Path, Path]:
    path, cfg = make_config(generate={"num_generations": 1})
    run_stage("generate", cfg, 0, quiet=True)
    return path, Path(cfg.run_dir)


def test_status_sql_and_report_take_the_config_file(small_run: tuple[Path, Path], tmp_path: Path) -> None:
    conf, run_dir = small_run
    by_dir = runner.invoke(app, ["status", "--run-dir", str(run_dir)])
    assert by_dir.exit_code == 0 and re.search(r"0  rollouts +complete +12 ", by_dir.stdout)
    for args in (["status", str(conf)], ["status", "--config", str(conf)], ["status", str(run_dir)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and res.stdout == by_dir.stdout, args
    res = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM rollouts", "-c", str(conf), "-f", "csv"])
    assert res.exit_code == 0 and res.stdout.splitlines() == ["n", "12"]
    res = runner.invoke(app, ["report", str(conf), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0 and (tmp_path / "rep" / "report.html").is_file()
    res = runner.invoke(app, ["status", str(conf), "--run-dir", str(run_dir)])
    assert isinstance(res.exception, UserError) and "not several" in str(res.exception)


@pytest.mark.parametrize("command", [["status"], ["sql", "SELECT 1"], ["report"]])
def test_a_directory_holding_no_run_is_an_error_naming_it(command: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert (
        proc.stderr
        == f"error: {tmp_path}: holds no run (no iter=* folder); give the config file or the run directory\n"
    )
    assert not (tmp_path / "report").exists()


def test_a_config_whose_run_dir_is_missing_names_both(make_config) -> None:
    conf, cfg = make_config()
    res = runner.invoke(app, ["status", str(conf)])
    assert str(res.exception) == f"{cfg.run_dir}: run directory not found (run_dir of {conf})"
