"""torch.distributed, as torchrun sets it up: rank and world size, barriers, device per rank.

Every stage works unchanged on one process; under `torchrun --nproc-per-node N -m rlhf_batch
STAGE ...` the CLI calls `init()` and the stages split their parts by rank. Every stage that
loads a model puts it on `stage_device(cfg.device)`: GPU LOCAL_RANK of its node under torchrun.

Fan-out without a process group (generate, score, eval): N independent processes, started
apart (a Slurm array, a Kubernetes Indexed Job, Airflow mapped tasks, N shells), each given its
rank (`--rank R --world-size N`, or `--world-size auto`: from the scheduler's environment, see
`fanout_from`; never from the environment alone). Each
writes the parts n with n % N == R; there are no barriers, and whichever process finds every
part on the store commits the manifest (store/output.py).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

from rlhf_batch.errors import UserError


def init(device: str = "cpu") -> None:
    """Join the process group torchrun describes in the environment (no-op without it). Under
    torchrun even one process joins (a group of one), so that train.fsdp shards on one GPU too."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not launched_by_torchrun():
        return
    import torch.distributed as td

    if not td.is_initialized():
        from rlhf_batch.runtime.device import resolve_device

        backend = "nccl" if resolve_device(device).startswith("cuda") else "gloo"
        td.init_process_group(backend=backend)
        atexit.register(_leave)


def launched_by_torchrun() -> bool:
    """torchrun (torch.distributed.run) sets these for every process it starts."""
    return all(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK"))


def in_group() -> bool:
    """Whether this process has joined a process group (`init` under torchrun), even of one."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as td

    return td.is_available() and td.is_initialized()


def _leave() -> None:
    """Destroy the process group while the interpreter is whole: a gloo worker thread that still
    holds a tensor of the last collective otherwise aborts the process (SIGABRT) at exit."""
    import torch.distributed as td

    if td.is_initialized():
        td.destroy_process_group()


_fanout: tuple[int, int] | None = None  # (rank, world) of an independent fan-out process


def grouped() -> bool:
    """Whether this process is in a torch.distributed process group (torchrun)."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as td

    return bool(td.is_available() and td.is_initialized())


def rank_world() -> tuple[int, int]:
    """(rank, world size): torchrun's process group, else the fan-out's, else (0, 1)."""
    if grouped():
        import torch.distributed as td

        return td.get_rank(), td.get_world_size()
    return _fanout or (0, 1)


def leads() -> bool:
    """Whether this process does what one process does for all (the identity file, the manifest,
    the trackers): rank 0 of a process group; every independent fan-out process."""
    return not grouped() or rank_world()[0] == 0


def fanned_out() -> bool:
    return _fanout is not None and _fanout[1] > 1 and not grouped()


def set_fanout(rank: int | None, world: int | str | None) -> None:
    """This process's place in a fan-out (None, None: none, whatever the environment holds)."""
    global _fanout
    _fanout = fanout_from(rank, world, os.environ)


@contextlib.contextmanager
def fanout(given: tuple[int | None, int | str | None] | None) -> Iterator[None]:
    """`set_fanout(*given)` while the block runs (a stage command), none after it; None: as is."""
    if given is None:
        yield
        return
    set_fanout(*given)
    try:
        yield
    finally:
        set_fanout(None, None)


def fanout_from(rank: int | None, world: int | str | None, env: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, world) of a fan-out the command asked for, else None: a scheduler's variables alone
    never fan a command out (a `run` or a plain stage inside a multi-task allocation writes every
    part). `--rank R --world-size N`: as given; `--world-size N`: the rank from the scheduler
    (`scheduler_rank`); `--world-size auto`: rank and world size from the scheduler, or from
    torchrun's process group when torchrun launched the process (None here)."""
    if rank is None and world is None:
        return None
    if world is None:
        raise UserError("--rank and --world-size go together (--world-size auto: both from the scheduler)")
    if str(world).strip().lower() == "auto":
        if rank is not None:
            raise UserError("--rank with --world-size auto: the scheduler's environment gives the rank")
        if "TORCHELASTIC_RUN_ID" in env or _int(env.get("WORLD_SIZE") or "1", "WORLD_SIZE") > 1:
            return None  # torchrun's (or a PyTorchJob's) process group gives the ranks
        rank, world = scheduler_rank(env, None)
    else:
        world = _int(str(world), "--world-size")
        if rank is None:
            rank, world = scheduler_rank(env, world)
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"--rank {rank} --world-size {world}: the rank must be in 0..world size - 1")
    if int(env.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--rank/--world-size: this process runs under torchrun, whose ranks it uses")
    return rank, world


def scheduler_rank(env: Mapping[str, str], world: int | None) -> tuple[int, int]:
    """(rank, world) from the scheduler's environment (`world`, when given, is the world size): a
    Slurm array (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of SLURM_ARRAY_TASK_COUNT), a
    Kubernetes Indexed Job (JOB_COMPLETION_INDEX; the world size given once: --world-size N or
    RLHF_BATCH_WORLD_SIZE), Slurm tasks (SLURM_PROCID of SLURM_NTASKS, unless torchrun launched
    the process)."""
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        lowest = _int(env.get("SLURM_ARRAY_TASK_MIN", "0"), "SLURM_ARRAY_TASK_MIN")
        rank = _int(env["SLURM_ARRAY_TASK_ID"], "SLURM_ARRAY_TASK_ID") - lowest
        return rank, world or _int(env["SLURM_ARRAY_TASK_COUNT"], "SLURM_ARRAY_TASK_COUNT")
    if "JOB_COMPLETION_INDEX" in env:
        if world is None and not env.get("RLHF_BATCH_WORLD_SIZE"):
            raise UserError(
                "JOB_COMPLETION_INDEX is set: give the world size once (--world-size N or RLHF_BATCH_WORLD_SIZE)"
            )
        world = world or _int(env["RLHF_BATCH_WORLD_SIZE"], "RLHF_BATCH_WORLD_SIZE")
        return _int(env["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX"), world
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "TORCHELASTIC_RUN_ID" not in env:
        rank = _int(env["SLURM_PROCID"], "SLURM_PROCID")
        tasks = _int(env["SLURM_NTASKS"], "SLURM_NTASKS")
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
        if tasks > 1 and step in (None, "", "4294967294", "batch"):  # the batch script: one process
            raise UserError(
                f"--world-size: SLURM_NTASKS={tasks} but this process is the job's batch script, not "
                "one of its srun tasks (no SLURM_STEP_ID): it would write 1 part in "
                f"{tasks}; run it under srun, or give --rank R --world-size N"
            )
        return rank, world or tasks
    raise UserError(
        "--world-size: no rank in the environment (a Slurm array or tasks: SLURM_ARRAY_TASK_ID, "
        "SLURM_PROCID; a Kubernetes Indexed Job: JOB_COMPLETION_INDEX); give --rank R --world-size N"
    )


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{name}={text!r}: not a whole number") from None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier() -> None:
    if grouped() and rank_world()[1] > 1:
        import torch.distributed as td

        td.barrier()


def all_sum(n: int) -> int:
    """The sum of `n` over the ranks (every rank calls it), `n` itself on one process."""
    if not grouped() or rank_world()[1] <= 1:
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
