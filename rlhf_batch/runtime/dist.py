"""torch.distributed, as torchrun sets it up: rank and world size, barriers, device per rank.

Every stage works unchanged on one process; under `torchrun --nproc-per-node N -m rlhf_batch
STAGE ...` the CLI calls `init()` and the stages split their parts by rank. Every stage that
loads a model puts it on `stage_device(cfg.device)`: GPU LOCAL_RANK of its node under torchrun.
"""

from __future__ import annotations

import atexit
import os
import sys


def init(device: str = "cpu") -> None:
    """Join the process group torchrun describes in the environment (no-op without it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import torch.distributed as td

    if not td.is_initialized():
        from rlhf_batch.runtime.device import resolve_device

        backend = "nccl" if resolve_device(device).startswith("cuda") else "gloo"
        td.init_process_group(backend=backend)
        atexit.register(_leave)


def _leave() -> None:
    """Destroy the process group while the interpreter is whole: a gloo worker thread that still
    holds a tensor of the last collective otherwise aborts the process (SIGABRT) at exit."""
    import torch.distributed as td

    if td.is_initialized():
        td.destroy_process_group()


def rank_world() -> tuple[int, int]:
    if "torch.distributed" not in sys.modules:
        return 0, 1
    import torch.distributed as td

    if td.is_available() and td.is_initialized():
        return td.get_rank(), td.get_world_size()
    return 0, 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier() -> None:
    if rank_world()[1] > 1:
        import torch.distributed as td

        td.barrier()


def all_sum(n: int) -> int:
    """The sum of `n` over the ranks (every rank calls it), `n` itself on one process."""
    if rank_world()[1] <= 1:
        return n
    import torch
    import torch.distributed as td

    device = f"cuda:{torch.cuda.current_device()}" if td.get_backend() == "nccl" else "cpu"
    total = torch.tensor([n], dtype=torch.int64, device=device)
    td.all_reduce(total)
    return int(total.item())


def rank_device(device: str, local_rank: int) -> str:
    """A resolved device ("cpu", "cuda") -> the one rank `local_rank` of a node uses."""
    return f"cuda:{local_rank}" if device == "cuda" else device


def stage_device(device: str) -> str:
    """The config's device (auto/cpu/cuda) -> this rank's device, made CUDA's current device."""
    from rlhf_batch.runtime.device import resolve_device

    dev = rank_device(resolve_device(device), local_rank())
    if dev.startswith("cuda"):
        import torch

        torch.cuda.set_device(dev)
    return dev
