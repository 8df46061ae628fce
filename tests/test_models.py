"""dtype from config: explicit names map as written; `auto` picks bfloat16 only where it is fast."""

from pathlib import Path

import pytest
import torch

from rlhf_batch.models import load_model, resolve_dtype


@pytest.mark.parametrize(
    "name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_explicit_dtypes_are_taken_as_written_on_any_device(name: str, dtype: torch.dtype) -> None:
    assert resolve_dtype(name, "cpu") is dtype and resolve_dtype(name, "cuda") is dtype


def test_auto_on_cpu_is_bfloat16_exactly_when_the_cpu_has_bf16_matrix_units() -> None:
    flags = {
        word
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("flags")
        for word in line.split(":", 1)[1].split()
    }
    fast = bool(flags & {"amx_bf16", "avx512_bf16"})  # AMX or AVX-512 BF16 instructions
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if fast else torch.float32)


def test_a_model_loads_in_the_dtype_asked_for(tiny_model: Path) -> None:
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        model = load_model(str(tiny_model), "policy", dtype=name)
        assert {p.dtype for p in model.parameters()} == {dtype}
