"""A full disk, two `run` commands on one run directory, and determinism, each with real
`rlhf-batch run` processes compared with the uninterrupted reference run."""

from __future__ import annotations

import resource
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from rlhf_batch.store import layout, manifests
from rlhf_batch.store.layout import LOCK
from tests.reliability.harness import (
    KILLS,
    Assets,
    assert_same_as_reference,
    command,
    environment,
    leftovers,
    read_metrics,
    run,
    run_to_completion,
    snapshot,
    wait_for,
    weights,
)


def file_size_limit(n_bytes: int):  # noqa: ANN201
    """A preexec_fn: no file of the process may grow beyond n_bytes (`ulimit -f`); a write past it
    fails with EFBIG (Python ignores SIGXFSZ), as on a full disk."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.slow
def test_a_full_disk_leaves_no_partial_file_and_a_rerun_completes(
    assets: Assets, reference: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # 4 KB: the first rollouts part (~12 KB) cannot be written
    res = run(assets, run_dir, iterations=1, preexec=file_size_limit(4096))
    line = one_line_error(res.stderr)
    rollouts = layout.folder(run_dir, 0, "rollouts")
    assert res.returncode == 1
    assert f"{rollouts / layout.part_name(0, 0)}: cannot write (File too large); free disk space" in line
    assert layout.list_parts(rollouts) == [] and leftovers(run_dir) == ["iter=0000/rollouts/_started.json"]
    # 100 KB: every table fits, the train checkpoint's weights (~330 KB) do not
    res = run(assets, run_dir, iterations=1, preexec=file_size_limit(100_000))
    line = one_line_error(res.stderr)
    train = layout.folder(run_dir, 0, "train")
    assert res.returncode == 1 and f"{train / 'checkpoint' / 'step-00000002'}: cannot write (" in line
    for stage in ("rollouts", "scores", "advantages"):
        assert manifests.manifest(layout.folder(run_dir, 0, stage)) is not None
    assert not any((train / "checkpoint").iterdir()) and not layout.policy_dir(run_dir, 0).exists()
    assert manifests.manifest(train) is None
    # space freed: the run completes with the rows and weights of the uninterrupted run
    run_to_completion(assets, run_dir, iterations=1)
    assert_same_as_reference(run_dir, reference, iterations=1)


@pytest.mark.slow
def test_a_second_run_is_refused_and_a_killed_holder_is_taken_over(
    assets: Assets, reference: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        command(assets, run_dir, iterations=1),
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(
        lambda: f"pid {first.pid} " in ((run_dir / LOCK).read_text() if (run_dir / LOCK).exists() else "")
    )
    before = snapshot(run_dir)
    second = run(assets, run_dir, iterations=1)
    assert first.poll() is None, "the first run ended before the second one started: no overlap was tested"
    line = one_line_error(second.stderr)
    assert second.returncode == 1 and f"holds the lock (pid {first.pid} on " in line
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k in before} == before  # the refused run touched nothing
    first.send_signal(signal.SIGKILL)  # the holder dies: its pid stays in the lock file
    assert first.wait() == -signal.SIGKILL
    KILLS["named"] += 1
    assert f"pid {first.pid} " in (run_dir / LOCK).read_text()
    run_to_completion(assets, run_dir, iterations=1)
    assert_same_as_reference(run_dir, reference, iterations=1)


@pytest.mark.slow
def test_same_config_and_seed_give_byte_identical_tables_and_weights(
    assets: Assets, reference: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"  # another directory: the tables hold no path of it in iteration 0
    run_to_completion(assets, run_dir, iterations=1)
    for stage in ("rollouts", "scores", "advantages"):
        files = [layout.folder(d, 0, stage) for d in (run_dir, reference)]
        names = [sorted(p.name for p in layout.list_parts(f)) for f in files]
        assert names[0] == names[1] and names[0]
        for name in names[0]:
            assert (files[0] / name).read_bytes() == (files[1] / name).read_bytes(), f"{stage}/{name}"
    got, want = weights(layout.policy_dir(run_dir, 0)), weights(layout.policy_dir(reference, 0))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert read_metrics(run_dir, 0).equals(read_metrics(reference, 0))
