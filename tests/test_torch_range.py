"""The torch versions pyproject accepts: the lower bound is what the pinned dependencies allow, and
the one API the package uses that is newer than it (DDP's forward_sync_buffers, torch 2.13) has a
fallback for the older releases."""

from __future__ import annotations

import tomllib
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version
from torch.nn.parallel import DistributedDataParallel

from rlhf_batch.stages.train.parallel import no_forward_buffer_sync

ROOT = Path(__file__).resolve().parents[1]


def lower_bound(spec: str) -> Version:
    (clause,) = [c for c in Requirement(spec).specifier if c.operator == ">="]
    return Version(clause.version)


def test_the_torch_lower_bound_is_the_one_the_pinned_tensordict_needs() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ours = lower_bound(next(d for d in deps if Requirement(d).name == "torch"))
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    assert Version(pins["torch"]) >= ours  # make setup's torch is in the range
    tensordict = next(r for r in requires("tensordict") or [] if Requirement(r).name == "torch")
    assert Version(f"{ours}.0") >= Version(lower_bound(tensordict).base_version)  # tensordict: >=2.11.0a0
    assert str(ours) == "2.11"


class DDPBefore213:
    """The parameters of DistributedDataParallel.__init__ in the torch releases before 2.13 (as in
    2.6-2.12): buffer syncing is `broadcast_buffers`; there is no `forward_sync_buffers`."""

    def __init__(
        self,
        module,  # noqa: ANN001
        device_ids=None,  # noqa: ANN001
        output_device=None,  # noqa: ANN001
        dim=0,  # noqa: ANN001
        broadcast_buffers=True,  # noqa: ANN001
        init_sync=True,  # noqa: ANN001
        process_group=None,  # noqa: ANN001
        bucket_cap_mb=None,  # noqa: ANN001
        find_unused_parameters=False,  # noqa: ANN001
        check_reduction=False,  # noqa: ANN001
        gradient_as_bucket_view=False,  # noqa: ANN001
        static_graph=False,  # noqa: ANN001
    ) -> None: ...


def test_ddp_buffer_switch_for_the_installed_torch_and_the_older_releases() -> None:
    assert no_forward_buffer_sync(DistributedDataParallel) == {"forward_sync_buffers": False}
    assert no_forward_buffer_sync(DDPBefore213) == {"broadcast_buffers": False}
