"""The only module that loads models and tokenizers: local Hugging Face dirs, safetensors only.

`trust_remote_code` stays off unless the config turns it on. A model given as a hub id
(``org/name`` or ``org/name@revision``, when no such local directory exists) is resolved once,
when the config is loaded, to its snapshot directory in the Hugging Face cache
(`huggingface_hub.snapshot_download`, honouring ``HF_HOME`` / ``HF_HUB_CACHE`` and
``HF_HUB_OFFLINE``); from then on it is a local directory like any other (`local_files_only`),
and manifests record its hub id and resolved revision. Device and dtype come from the config
("auto" picks CUDA when present, and bfloat16 where the hardware has bf16 matrix units).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rlhf_batch.errors import ModelError
from rlhf_batch.models import resident
from rlhf_batch.runtime.device import resolve_device, resolve_dtype
from rlhf_batch.store.fs import local_dir, run_path
from rlhf_batch.store.modeldir import check_model_dir, refuse_removed


def _needs_remote_code(p: Path) -> bool:
    import json

    cfg = json.loads((p / "config.json").read_text())
    return "auto_map" in cfg


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A tokenizer with a pad token: when it has none, the EOS token serves (masks come from
    lengths, so pad == eos loses nothing). Padding side is set by the caller per use."""
    from transformers import AutoTokenizer

    p = run_path(path)
    if not p.is_dir():
        refuse_removed(p, "tokenizer")
        raise ModelError(f"tokenizer directory not found: {p}")
    p = local_dir(p)  # a directory on the object store: its local copy
    key = None if trust_remote_code else _files_digest(p)
    if key in _TOKENIZERS:  # a copy: callers own what they get
        tok = copy.deepcopy(_TOKENIZERS[key])
        tok.name_or_path = tok.init_kwargs["name_or_path"] = str(p)
        return tok
    try:
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"{p}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
    if not tok("a b 1", add_special_tokens=False)["input_ids"]:
        raise ModelError(f"{p}: the tokenizer turns text into no tokens (is tokenizer.json missing?)")
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelError(f"{p}: tokenizer has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    if key is not None:
        _TOKENIZERS[key] = copy.deepcopy(tok)
    return tok


# Tokenizers loaded in this process, by the content of their directory's files other than weights:
# each iteration's policy directory holds the same tokenizer files, and a copy costs ~0.3 ms
# against ~1.5 ms to load the demo's (hundreds of ms for a 150k vocabulary).
_TOKENIZERS: dict[str, Any] = {}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def _files_digest(p: Path, limit: int = 256 << 20) -> str | None:
    """sha256 over the names and bytes of the directory's files other than weights (None above
    `limit` bytes: hashing would cost more than it saves)."""
    import hashlib

    files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES))
    if sum(f.stat().st_size for f in files) > limit:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def load_model(
    path: str,
    what: str,
    *,
    kind: str = "causal",
    device: str = "cpu",
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> Any:
    """Load a causal LM (`kind="causal"`) or a 1-label reward model (`kind="reward"`), in eval mode;
    one that would attend with SDPA attends with `attention.matmul_attention`."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlhf_batch.models.attention import use_matmul_attention

    hf_logging.disable_progress_bar()
    p = local_dir(check_model_dir(path, what))  # a directory on the object store: its local copy
    if _needs_remote_code(p) and not trust_remote_code:
        raise ModelError(
            f"{what}: {p} needs remote code (config.json has auto_map); "
            "set trust_remote_code = true only if you trust it"
        )
    dev = resolve_device(device)
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    from safetensors import SafetensorError

    torch_dtype = resolve_dtype(dtype, dev)
    try:
        # templates only in a process that loads models again and again (resident.keep)
        key = _template_key(p, kind, str(torch_dtype), dev, trust_remote_code) if resident.enabled() else None
        if key in _TEMPLATES:
            model = _TEMPLATES[key].load(p, dev)  # its config attends as the first load's
            check_loaded(model, {}, p, what)
            return model
        resident.DISK_READS["model"] += 1
        model, info = cls.from_pretrained(  # type: ignore[misc]  # a tuple with output_loading_info
            p,
            dtype=torch_dtype,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            output_loading_info=True,
            # off the CPU: the files are read straight to the device (no CPU copy of the model)
            **({"device_map": dev} if dev != "cpu" else {}),
        )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise ModelError(f"{what}: cannot load {p} ({_first_line(e)})") from None
    check_loaded(model, info, p, what)
    if kind == "reward" and model.config.num_labels != 1:
        raise ModelError(f"{what}: {p} has {model.config.num_labels} labels; a reward model needs 1")
    if kind == "reward" and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    model.to(dev)  # type: ignore[arg-type]  # transformers types .to() oddly
    model.eval()
    use_matmul_attention(model)
    if key is not None and (template := _Template.of(model, p, dev)) is not None:
        _TEMPLATES[key] = template
    return model


# ---------------------------------------------------------------- models of a known shape
#
# A process that loads models of one config again and again (`run` with `in_process`, a lane:
# models/resident.keep) builds the model once. The first load goes through `from_pretrained`; if
# every tensor it holds is exactly the file's (same name, the file's values in the loaded dtype;
# the tensors the files lack are tied to ones they have), it is kept as a template without
# weights (on the meta device). A later load of a directory with the same config.json,
# generation_config.json and weight names, shapes and dtypes (its safetensors headers) copies
# the template and takes the weights from that directory's files, or from memory when the
# process holds them (models/resident.py): ~2 ms instead of ~8 ms for the demo's model. Making
# a template reads the files a second time and compares them (1-2 s for a 162 MB model on a
# loaded 2-core CPU): a stage process, which loads each model once, makes none. Models over
# TEMPLATE_MAX_BYTES, models with remote code and anything else load as before.

_TEMPLATES: dict[tuple[Any, ...], _Template] = {}
# Above this, loading is the weights' I/O, which a template does not save, and making one (the
# files read a second time and compared) would cost seconds and the model's size in memory.
TEMPLATE_MAX_BYTES = 1 << 30


def own_memory(params: Any) -> None:
    """Copy CPU parameters into memory of their own before anything writes them. Loaded weights
    are a private mapping of the checkpoint file: the first write to each 4 kB page (the first
    optimizer step) faults and copies it, ~5 us a page (a 40M-parameter float32 model: the first
    AdamW step 0.56 s, 0.09 s after this copy, which takes 0.02 s)."""
    import torch

    with torch.no_grad():
        for p in params:
            if p.device.type == "cpu":
                p.data = p.data.clone()


def _weight_files(p: Path) -> list[Path] | None:
    """The safetensors files `from_pretrained` reads (one file, or the shards of its index)."""
    import json

    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    index = p / "model.safetensors.index.json"
    if index.is_file():
        return [p / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return None


def _read_weights(p: Path, device: str = "cpu") -> dict[str, Any]:
    """Every tensor of the directory's weight files, by name."""
    from safetensors.torch import load_file

    weights: dict[str, Any] = {}
    for f in _weight_files(p) or []:
        weights.update(load_file(str(f), device=device))
    return weights


def _template_key(
    p: Path, kind: str, dtype: str, device: str, trust_remote_code: bool
) -> tuple[Any, ...] | None:
    from safetensors import safe_open

    files = _weight_files(p)
    if files is None or trust_remote_code or sum(f.stat().st_size for f in files) > TEMPLATE_MAX_BYTES:
        return None
    header = []
    for f in files:
        with safe_open(str(f), "pt") as st:
            names = st.keys()  # a list; the handle is not iterable
            header += [(k, st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in names]
    gen = p / "generation_config.json"
    texts = [(p / "config.json").read_text(), gen.read_text() if gen.is_file() else None]
    return (kind, dtype, device, *texts, tuple(sorted(header)))


class _Template:
    """A loaded model's structure without its weights, and what a load must put back."""

    def __init__(self, module: Any, dtypes: dict[str, Any], buffers: dict[str, Any]):
        self.module, self.dtypes, self.buffers = module, dtypes, buffers

    @classmethod
    def of(cls, model: Any, p: Path, device: str = "cpu") -> _Template | None:
        """The template of `model` just loaded from `p` (to `device`), or None when its tensors
        are not exactly the files' (a renamed or converted weight, a weight the files lack
        untied). The files' tensors it read are kept (resident.py) on `device`."""
        import torch

        state = model.state_dict()  # [name -> tensor], tied weights under each name
        files = _read_weights(p)
        if not set(files) <= set(state):
            return None
        file_ptrs = {state[k].data_ptr() for k in files}
        if not all(state[k].data_ptr() in file_ptrs for k in state if k not in files):  # lacking, untied
            return None
        for k, t in files.items():
            if not torch.equal(state[k].cpu(), t.to(state[k].dtype)):
                return None
        tensors = [*model.parameters(), *model.buffers()]
        memo = {
            id(t): torch.nn.Parameter(t.to("meta"), t.requires_grad)
            if isinstance(t, torch.nn.Parameter)
            else t.to("meta")
            for t in tensors
        }
        module = copy.deepcopy(model, memo)
        buffers = {k: b.detach().clone() for k, b in model.named_buffers() if k not in state}  # not saved
        resident.put_weights(p, {k: t.to(device) for k, t in files.items()})
        return cls(module, {k: state[k].dtype for k in files}, buffers)

    def load(self, p: Path, device: str) -> Any:
        """A copy of the template holding `p`'s weights (the key saw the same names, shapes and
        dtypes in its files: only the tied tensors are missing until `tie_weights`), taken from
        memory when the process keeps them (resident.py), else read from the files (and kept)."""
        model = copy.deepcopy(self.module)
        source = resident.weights(p)  # a copy of what this process keeps, or None
        if source is None:
            resident.DISK_READS["model"] += 1
            source = _read_weights(p, device)
            resident.put_weights(p, source)  # on the CPU a packed copy; on a device, kept: copied below
            if device != "cpu":
                source = {k: t.clone() for k, t in source.items()}
        weights = {k: t.to(device=device, dtype=self.dtypes[k]) for k, t in source.items()}
        model.load_state_dict(weights, strict=False, assign=True)
        for name, b in self.buffers.items():
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = b.to(device, copy=True)
        model.tie_weights()
        model.config._name_or_path = model.name_or_path = str(p)
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            raise ModelError(f"{p}: a weight was left unloaded")
        return model


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if "ignore_mismatched_sizes" in text:  # transformers prints the tensors in a table above
        return "weights of the wrong shape for its config.json"
    return text.splitlines()[0] if text else type(e).__name__


def check_loaded(model: Any, info: dict[str, Any], p: Path, what: str) -> None:
    """Every weight came from the files (none silently random-initialised) and is finite."""
    import torch

    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(f"{what}: {p} lacks the weight {missing[0]}{more}; the files are incomplete")
    floats = [
        (n, t)
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() and t.numel()
    ]
    if not floats:
        return
    # the least and greatest value of each tensor: a NaN makes both NaN, an inf one of them (one
    # pass over the weights, ~6x faster than isfinite(t).all()), then one host sync for the model
    with torch.no_grad():
        ends = torch.stack(
            [torch.stack(torch.aminmax(t.detach())).float().to(floats[0][1].device) for _, t in floats]
        )
        finite = torch.isfinite(ends).all(dim=1)
    if not bool(finite.all()):
        name = floats[int((~finite).nonzero()[0, 0])][0]
        raise ModelError(f"{what}: {p} has non-finite values (NaN or inf) in {name}")


def keep_written(model: Any, p: Path) -> None:
    """`model` was just saved to the model directory `p` (train's policy): when this process
    keeps weights (resident.py), keep its tensors that the files hold (if they are what the
    files' headers say), so that the next load of `p` copies them instead of reading the files."""
    if resident.enabled():
        resident.put_weights(p, model.state_dict())


def vocab_signature(tok: Any) -> tuple[int, int]:
    """(vocab size, hash of the token->id map): tokenizers must agree to share token ids."""
    import hashlib

    items = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    return len(items), int(digest[:12], 16)


def saved_dtype(model_dir: str) -> Any:
    """The dtype a model dir's config.json names (float32 when none)."""
    import json

    import torch

    raw = json.loads((run_path(model_dir) / "config.json").read_text())
    name = raw.get("dtype") or raw.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
