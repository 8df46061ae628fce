"""Where and how a stage computes: the device and dtype the config asks for ("auto" picks CUDA
when present, and bfloat16 where the hardware has bf16 matrix units), the CPU's feature flags,
torch's thread count and glibc's allocator settings for a process that runs stages."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_batch.errors import ModelError

if TYPE_CHECKING:
    import torch


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("device: 'cuda' asked for, but torch sees no CUDA device")
    return device


def setup_process(threads: int) -> None:
    """For a process that runs stages (a stage command, `run` in one process): `threads` CPU
    threads in torch (0 keeps torch's default), and freed memory kept for reuse (below)."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    keep_freed_memory()


# glibc hands freed memory back to the system: blocks above its mmap threshold on free, the top
# of the heap once more than 128 kB of it is free. A stage allocates and frees tensors of tens of
# MB per layer (activations, attention probabilities, a chunk of logits), so each came back as
# fresh pages, and the first touch of every page faulted (bf16 score: SiLU of [18, 506, 1408]
# took 35 ms, ~10x what its bytes cost). Blocks up to 32 MB (glibc's largest threshold) now come
# from the heap, whose free memory is kept: bf16 score 9117 -> 9892 tokens/s (median of 3 fresh
# processes each, bench_score's 256 rollouts), train within the noise, peak RSS unchanged; the
# process's RSS no longer shrinks after a peak. Larger blocks come from the heap too (glibc maps
# none): a model with a large vocabulary allocates several [V, H] float32 blocks per micro-batch
# in train (the embedding's gradient, the LM head's cast weight and gradient: 545 MB each at
# Qwen2.5-0.5B's 151936 x 896), and each mapped anew faulted 133k pages (0.4-0.5 s).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4  # glibc's mallopt parameters


def keep_freed_memory() -> None:
    """Tell glibc's allocator to keep freed memory (above); nothing where it is not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    mallopt(M_TOP_PAD, 256 << 20)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(
        f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    )


def cpu_has_bf16() -> bool:
    """bf16 matrix units: AVX512-BF16 or AMX."""
    return bool(_cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_has_amx() -> bool:
    """AMX tiles for bf16 (Intel Sapphire Rapids and later): bf16 matmuls ~3x AVX512-BF16's."""
    return "amx_bf16" in _cpu_flags()


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
