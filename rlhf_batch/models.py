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

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def set_threads(threads: int) -> None:
    """Use `threads` CPU threads in torch (0 keeps torch's default)."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("amx_bf16", "avx512_bf16"))


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")  # org/name[@revision]
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # no other weights


def is_hub_id(spec: str) -> bool:
    """`org/name[@revision]` that is not an existing path."""
    return bool(HUB_ID.match(spec)) and not spec.startswith(".") and not Path(spec).expanduser().exists()


def hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (HF_HUB_CACHE, HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(spec: str, what: str) -> str:
    """The snapshot directory of hub id `spec` (`org/name[@revision]`) in the Hugging Face cache,
    downloaded first unless HF_HUB_OFFLINE is set; ModelError in one line otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    repo, _, revision = spec.partition("@")
    cache, offline = hub_cache(), hub_offline()
    try:
        path: str = snapshot_download(  # type: ignore[assignment]
            repo,
            revision=revision or None,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=HUB_FILES,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        rev = f" --revision {revision}" if revision else ""
        raise ModelError(
            f"{what}: {spec!r} is not a local directory and not in the Hugging Face cache ({cache}), and "
            f"HF_HUB_OFFLINE is set; fetch it with `hf download {repo}{rev}` (same HF_HOME) or unset HF_HUB_OFFLINE"
        ) from None
    except Exception as e:  # noqa: BLE001 - network, authentication, unknown repository
        raise ModelError(
            f"{what}: cannot fetch {spec!r} from the Hugging Face Hub ({str(e).splitlines()[0]})"
        ) from None
    return path


def hub_revision(path: str | Path) -> dict[str, str] | None:
    """{"id", "revision"} when `path` is a snapshot in a Hugging Face cache
    (.../models--org--name/snapshots/<commit>), else None."""
    parts = Path(path).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return {"id": parts[-3][len("models--") :].replace("--", "/"), "revision": parts[-1]}
    return None


def check_model_dir(path: str, what: str) -> Path:
    p = Path(path)
    if not path:
        raise ModelError(f"{what}: no model directory configured")
    if not p.is_dir():
        _refuse_removed(p, what)
        raise ModelError(f"{what}: model directory not found: {p}")
    if not (p / "config.json").is_file():
        raise ModelError(f"{what}: {p} has no config.json (not a Hugging Face model directory)")
    if not any(p.glob("*.safetensors")):
        raise ModelError(f"{what}: {p} has no *.safetensors weights (only safetensors are loaded)")
    return p


def _refuse_removed(p: Path, what: str) -> None:
    from rlhf_batch.retention import removed_record

    if (gone := removed_record(p)) is not None:
        raise ModelError(
            f"{what}: {p} was removed by keep_policies on {gone['removed']}; it cannot be loaded"
        )


def _needs_remote_code(p: Path) -> bool:
    import json

    cfg = json.loads((p / "config.json").read_text())
    return "auto_map" in cfg


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A tokenizer with a pad token: when it has none, the EOS token serves (masks come from
    lengths, so pad == eos loses nothing). Padding side is set by the caller per use."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        _refuse_removed(p, "tokenizer")
        raise ModelError(f"tokenizer directory not found: {p}")
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
    return tok


def load_model(
    path: str,
    what: str,
    *,
    kind: str = "causal",
    device: str = "cpu",
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> Any:
    """Load a causal LM (`kind="causal"`) or a 1-label reward model (`kind="reward"`), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    p = check_model_dir(path, what)
    if _needs_remote_code(p) and not trust_remote_code:
        raise ModelError(
            f"{what}: {p} needs remote code (config.json has auto_map); "
            "set trust_remote_code = true only if you trust it"
        )
    dev = resolve_device(device)
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    from safetensors import SafetensorError

    try:
        model, info = cls.from_pretrained(  # type: ignore[misc]  # a tuple with output_loading_info
            p,
            dtype=resolve_dtype(dtype, dev),
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            output_loading_info=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise ModelError(f"{what}: cannot load {p} ({_first_line(e)})") from None
    check_loaded(model, info, p, what)
    if kind == "reward" and model.config.num_labels != 1:
        raise ModelError(f"{what}: {p} has {model.config.num_labels} labels; a reward model needs 1")
    if kind == "reward" and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    model.to(dev)  # type: ignore[arg-type]  # transformers types .to() oddly
    return model.eval()


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
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ModelError(f"{what}: {p} has non-finite values (NaN or inf) in {name}")


def vocab_signature(tok: Any) -> tuple[int, int]:
    """(vocab size, hash of the token->id map): tokenizers must agree to share token ids."""
    import hashlib

    items = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    return len(items), int(digest[:12], 16)


def model_fingerprint(path: str, what: str) -> dict[str, Any]:
    """What identifies a model for the stage manifests, cheaply: its path, config.json and the
    names and sizes of its weight files (weights are not hashed: models can be many GB). A policy
    that keep_policies removed keeps the fingerprint recorded before its removal."""
    from rlhf_batch.retention import removed_record

    if (gone := removed_record(path)) is not None:
        return dict(gone["fingerprint"])
    p = check_model_dir(path, what)
    weights = {q.name: q.stat().st_size for q in sorted(p.glob("*.safetensors"))}
    out = {"path": str(p), "config": (p / "config.json").read_text(), "weights": weights}
    hub = hub_revision(p)
    return {**out, "hub": hub} if hub else out
