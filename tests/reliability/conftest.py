"""Session fixtures of the reliability suite: shared assets and ONE uninterrupted reference run
that every kill, disk-full and determinism test compares with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.harness import KILLS, WALL, Assets, run_to_completion


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    from rlhf_batch.data.demo import write_prompts
    from rlhf_batch.models.tiny import init_model

    root = tmp_path_factory.mktemp("assets")
    return Assets(
        prompts=write_prompts(root / "prompts.jsonl", 48, seed=0), policy=init_model(root / "policy", seed=0)
    )


@pytest.fixture(scope="session")
def reference(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shortened demo (2 iterations), run once without interruption."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    WALL["reference"] = run_to_completion(assets, run_dir)
    return run_dir


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    if KILLS["named"] or KILLS["timed"]:
        terminalreporter.write_line(
            f"reliability: {KILLS['named'] + KILLS['timed']} SIGKILLs survived "
            f"({KILLS['named']} at named fault points, {KILLS['timed']} at random moments)"
        )


@pytest.fixture
def ctx(tmp_path: Path, assets: Assets, reference: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """One bad-input case's directory (test_bad_inputs.Ctx): a config, copied stage inputs."""
    import torch

    from rlhf_batch.runtime import faults
    from tests.reliability.test_bad_inputs import Ctx

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RLHF_BATCH_DEBUG", raising=False)
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    threads = torch.get_num_threads()  # the commands set the config's threads = 1 in this process
    yield Ctx(tmp_path, assets, reference, monkeypatch)
    torch.set_num_threads(threads)
