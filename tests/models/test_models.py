"""dtype from config: explicit names map as written; `auto` picks bfloat16 only where it is fast.
A stage process keeps freed memory for reuse."""

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_batch.models.attention import MATMUL_ATTENTION, use_matmul_attention
from rlhf_batch.models.load import load_model
from rlhf_batch.runtime.device import resolve_dtype


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


@pytest.fixture
def no_templates() -> Any:
    """No template of an earlier test's model: each test sees which loads make one, in a process
    that keeps models (the only one that makes templates)."""
    from rlhf_batch.models import load as models
    from rlhf_batch.models import resident

    models._TEMPLATES.clear()
    with resident.keep():
        yield
    models._TEMPLATES.clear()


def _fresh(path: Path, kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model as transformers loads it, straight from its files (no rlhf-batch code)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    return cls.from_pretrained(path, dtype=dtype, local_files_only=True).eval()


@pytest.mark.parametrize("kind", ["causal", "reward"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_of_a_shape_loaded_before_equals_the_one_transformers_loads(
    tmp_path: Path, kind: str, dtype: str, monkeypatch: pytest.MonkeyPatch, no_templates: None
) -> None:
    """The second directory of the same config loads from the first one's template: its tensors,
    ties, buffers, modes and path are what `from_pretrained` gives for that directory."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_batch.models import load as models
    from rlhf_batch.models.tiny import init_model

    reward = kind == "reward"
    first = init_model(tmp_path / "a", reward=reward, seed=1)
    second = init_model(tmp_path / "b", reward=reward, seed=2)  # same config, other weights
    models.load_model(str(first), "m", kind=kind, dtype=dtype)
    calls: list[object] = []
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    real = cls.from_pretrained
    monkeypatch.setattr(cls, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k))
    got = models.load_model(str(second), "m", kind=kind, dtype=dtype)
    assert calls == []  # the template's path, not transformers'
    want = _fresh(second, kind, resolve_dtype(dtype, "cpu"))
    g, w = got.state_dict(), want.state_dict()
    assert list(g) == list(w)
    for k in w:
        assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k
    for (n, a), (_, b) in zip(got.named_buffers(), want.named_buffers(), strict=True):  # rotary frequencies
        assert torch.equal(a, b), n
    if not reward:  # tied: the head is the embedding, not a copy of it
        assert got.lm_head.weight is got.model.embed_tokens.weight
    assert all(p.requires_grad for p in got.parameters()) and not got.training
    assert got.name_or_path == str(second) and got.config.to_dict() == want.config.to_dict()
    assert got.config._attn_implementation == MATMUL_ATTENTION  # as load_model's first load
    use_matmul_attention(want)
    ids = torch.tensor([[5, 9, 14, 3, 7], [6, 2, 8, 11, 4]])
    out_g = got(ids).logits
    assert torch.equal(out_g, want(ids).logits)


def test_another_shape_or_changed_weights_load_through_transformers(
    tmp_path: Path, no_templates: None
) -> None:
    from safetensors.torch import load_file, save_file

    from rlhf_batch.models import load as models
    from rlhf_batch.models.tiny import init_model

    a = init_model(tmp_path / "a", seed=1)
    models.load_model(str(a), "m", dtype="float32")
    deeper = init_model(tmp_path / "deep", layers=3, seed=1)  # another config.json: no template
    got = models.load_model(str(deeper), "m", dtype="float32")
    assert len(got.model.layers) == 3 and len(models._TEMPLATES) == 2
    # a weight renamed in the file: another header, so transformers loads it (and names the problem)
    c = init_model(tmp_path / "c", seed=3)
    w = load_file(str(c / "model.safetensors"))
    w["model.norm.weight_renamed"] = w.pop("model.norm.weight")
    save_file(w, str(c / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(models.ModelError, match="lacks the weight model.norm.weight"):
        models.load_model(str(c), "m", dtype="float32")


def test_models_over_the_size_cap_get_no_template(
    tmp_path: Path, no_templates: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlhf_batch.models import load as models
    from rlhf_batch.models.tiny import init_model

    a = init_model(tmp_path / "a", seed=1)
    size = (a / "model.safetensors").stat().st_size
    monkeypatch.setattr(models, "TEMPLATE_MAX_BYTES", size - 1)
    models.load_model(str(a), "m", dtype="float32")
    assert models._TEMPLATES == {}
    monkeypatch.setattr(models, "TEMPLATE_MAX_BYTES", size)
    models.load_model(str(a), "m", dtype="float32")
    assert len(models._TEMPLATES) == 1


def test_a_tokenizer_with_the_same_files_is_a_copy_of_the_one_loaded_before(tmp_path: Path) -> None:
    import shutil

    from transformers import AutoTokenizer

    from rlhf_batch.models import load as models
    from rlhf_batch.models.tiny import init_model

    models._TOKENIZERS.clear()
    a = init_model(tmp_path / "a", seed=1)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    first = models.load_tokenizer(str(a))
    first.padding_side = "left"  # what one caller does to its tokenizer stays with it
    got = models.load_tokenizer(str(b))
    want = AutoTokenizer.from_pretrained(b, local_files_only=True)
    assert len(models._TOKENIZERS) == 1 and got is not first and got.padding_side == want.padding_side
    assert got.name_or_path == str(b) and got.init_kwargs == want.init_kwargs
    text = "<|im_start|>a*3=aaa<|im_end|>"
    assert got(text)["input_ids"] == want(text)["input_ids"] and got.get_vocab() == want.get_vocab()
    got.padding_side = "left"  # nor does it reach the next load
    assert models.load_tokenizer(str(a)).padding_side == want.padding_side
    # another chat template: other files, another tokenizer
    (b / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    other = models.load_tokenizer(str(b))
    assert len(models._TOKENIZERS) == 2
    assert other.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x"
    models._TOKENIZERS.clear()


HEAP = r"""
import ctypes, sys, torch
from rlhf_batch.runtime.device import setup_process
if sys.argv[1] == "1":
    setup_process(1)
class MallInfo(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo
mb = int(sys.argv[2])  # 24: a layer's activation; 100: above glibc's largest mmap threshold (32 MB)
block = torch.empty(mb << 20, dtype=torch.uint8).fill_(1)
during = libc.mallinfo2()
del block
after = libc.mallinfo2()
print(during.hblkhd >> 20, after.fordblks >> 20, torch.get_num_threads())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
@pytest.mark.parametrize("mb", [24, 100])
def test_a_stage_process_keeps_freed_memory_for_reuse(mb: int) -> None:
    # glibc's counters (MB): hblkhd = held in separate mmapped blocks, fordblks = free in its heap.
    # By default a fresh process mmaps a block of 24 MB or more (its threshold starts at 128 kB and
    # can never exceed 32 MB) and unmaps it on free: the next one faults its pages in again. A
    # stage process takes it from the heap and keeps it there when freed.
    def run(stage: str) -> list[int]:
        cmd = [sys.executable, "-c", HEAP, stage, str(mb)]
        return list(map(int, subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()))

    mapped, free_after, _ = run("0")
    assert mapped >= mb and free_after < mb
    mapped, free_after, threads = run("1")
    assert mapped < mb and free_after >= mb
    assert threads == 1


def _in_mapping_of(t: torch.Tensor, path: Path) -> bool:
    """Whether the tensor's memory lies in a mapping of `path` (/proc/self/maps)."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        if rest and rest[-1] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/maps")
def test_own_memory_moves_parameters_out_of_the_checkpoint_files_mapping(tiny_model: Path) -> None:
    from rlhf_batch.models.load import own_memory

    model = load_model(str(tiny_model), "policy", dtype="float32")
    params = list(model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    file = tiny_model / "model.safetensors"
    assert any(_in_mapping_of(p, file) for p in params)  # loaded weights live in the file's mapping
    own_memory(params)
    assert not any(_in_mapping_of(p, file) for p in params)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # same values
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # still tied


def test_a_process_that_keeps_no_models_makes_no_template(tmp_path: Path) -> None:
    """A stage process loads each model once: the template (a second read of the files and a
    comparison of every tensor) would be pure cost there."""
    from rlhf_batch.models import load as models
    from rlhf_batch.models import resident
    from rlhf_batch.models.tiny import init_model

    models._TEMPLATES.clear()
    a = init_model(tmp_path / "a", seed=1)
    reads = resident.DISK_READS["model"]
    models.load_model(str(a), "m", dtype="float32")
    models.load_model(str(a), "m", dtype="float32")
    assert models._TEMPLATES == {} and resident.DISK_READS["model"] == reads + 2
    with resident.keep():  # as `run` with in_process
        models.load_model(str(a), "m", dtype="float32")
        assert len(models._TEMPLATES) == 1
    models._TEMPLATES.clear()
