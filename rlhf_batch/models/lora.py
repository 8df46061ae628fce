"""LoRA policies (`[lora]`, built with peft): train updates only a low-rank adapter on the base
model (`policy_model`), which stays frozen for the whole run.

    iter=K/policy/                  merged full weights (W + alpha/r * B @ A) + tokenizer: a plain
                                    Hugging Face dir, what generate, score and import load
    iter=K/policy/adapter/          the peft adapter (adapter_config.json, adapter_model.safetensors)
    RUN_DIR/init_policy/            only with lora.init_adapter: base + that adapter, merged, with a
                                    copy of the adapter (the policy of iteration 0)

Train of iteration K loads the base once and puts iteration K-1's adapter on it (a fresh one,
B = 0, at iteration 0, or `lora.init_adapter`); it saves the new adapter and the merged weights
next to it in one atomic rename. The reference is the base with the adapter disabled, i.e. the
base model itself: score loads `policy_model` (only it) for the reference log-probs, and train
reads them from the advantages rows. Adapters are read from safetensors only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.store import layout
from rlhf_batch.store.fs import run_path
from rlhf_batch.store.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, INIT_ADAPTER, LORA_BASE_COPY
from rlhf_batch.store.modeldir import same_dir

if TYPE_CHECKING:
    from rlhf_batch.config import Config


def peft_config(cfg: Config) -> Any:
    from peft import LoraConfig

    lc = cfg.lora
    targets: Any = "all-linear" if lc.target_modules == ["all-linear"] else list(lc.target_modules)
    return LoraConfig(
        r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets, bias="none"
    )


def train_base(cfg: Config, start: str) -> tuple[str, Path | None]:
    """(model dir train loads, adapter dir to put on it): without LoRA (start, None); with it the
    base (`policy_model`) and the adapter of the policy `start` (None for the base itself: a
    fresh adapter)."""
    if not cfg.lora.enabled:
        return start, None
    if same_dir(start, cfg.policy_model) or (run_path(start) / LORA_BASE_COPY).is_file():
        return cfg.policy_model, None
    adapter = run_path(start) / layout.ADAPTER_DIR
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise StageError(
            f"{start}: no LoRA adapter ({adapter / ADAPTER_WEIGHTS}); this policy was trained without "
            "[lora]: a run uses lora.enabled from its first iteration, or not at all"
        )
    return cfg.policy_model, adapter


def wrap(cfg: Config, model: Any, adapter: Path | None) -> Any:
    """`model` (the base) with a trainable LoRA adapter: fresh (B = 0: the policy is the base), or
    the weights of `adapter`. Everything but the adapter is frozen."""
    from peft import get_peft_model

    if adapter is not None:
        check_adapter(cfg, adapter)
    peft_model = get_peft_model(model, peft_config(cfg))
    if adapter is not None:
        load_adapter(peft_model, adapter)
    return peft_model


def check_adapter(cfg: Config, adapter: Path) -> None:
    """An adapter's r and alpha must be the config's (the update's scale depends on them)."""
    path = adapter / ADAPTER_CONFIG
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"{path}: cannot read the adapter config ({e})") from None
    for ours, theirs in (("r", "r"), ("alpha", "lora_alpha")):
        want, got = getattr(cfg.lora, ours), saved.get(theirs)
        if got is None or float(got) != float(want):
            raise ConfigError(f"lora.{ours}: is {want}, but the adapter {adapter} has {theirs} = {got}")


def check_targets(cfg: Config) -> None:
    """Each name in lora.target_modules matches a module of the base model, checked on an empty
    (meta-device) model built from its config.json: a misspelt name fails before any stage runs."""
    from rlhf_batch.store.fs import run_path
    from rlhf_batch.store.modeldir import config_dir

    lc = cfg.lora
    if not lc.enabled or lc.target_modules == ["all-linear"]:
        return
    base = run_path(cfg.policy_model, "policy_model")
    if not (base / "config.json").is_file():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with config_dir(base) as local:  # a model on a store: its config.json, not its weights
        conf = AutoConfig.from_pretrained(
            local, trust_remote_code=cfg.trust_remote_code, local_files_only=True
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf, trust_remote_code=cfg.trust_remote_code)
    names = [n for n, _ in model.named_modules()]
    for t in lc.target_modules:
        if not any(n == t or n.endswith("." + t) for n in names):
            linear = sorted(
                {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            )
            raise ConfigError(
                f"lora.target_modules: {t!r} names no module of {base} (its linear layers: {', '.join(linear)})"
            )


def load_adapter(peft_model: Any, adapter: Path) -> None:
    """Load adapter weights (safetensors only) into `peft_model`; every LoRA weight of the model
    must be in the file, with its shape, and nothing else."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(adapter / ADAPTER_WEIGHTS))
        result = set_peft_model_state_dict(peft_model, weights)
    except (OSError, SafetensorError, RuntimeError) as e:  # size mismatch: an adapter of another model
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
        raise ConfigError(f"{adapter}: the adapter does not fit this model ({first})") from None
    unexpected = list(result.unexpected_keys)  # type: ignore[attr-defined]  # typed as a bare namedtuple
    ours = [n for n, _ in peft_model.named_parameters() if ".lora_" in n]
    if unexpected or len(weights) != len(ours):
        raise ConfigError(
            f"lora.target_modules: the adapter {adapter} has {len(weights)} weights for "
            f"{len(ours)} LoRA weights of this config ({unexpected[:2]} unexpected)"
        )


def save_adapter(model: Any, out: Path) -> Any:
    """Before a policy is saved to `out`: a LoRA model writes its adapter to out/adapter and
    returns the merged base model (W + alpha/r * B @ A); any other model is returned as it is."""
    peft = sys.modules.get("peft")  # not imported: not a LoRA model (spares the import)
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    # the adapter only: with embed_tokens targeted peft would add the (frozen) base embeddings
    model.save_pretrained(str(out / layout.ADAPTER_DIR), safe_serialization=True, save_embedding_layers=False)
    return model.merge_and_unload()


def trainable(model: Any) -> list[Any]:
    return [p for p in model.parameters() if p.requires_grad]


def initial_policy(cfg: Config) -> str:
    """The policy of iteration 0 with `lora.init_adapter`: base + that adapter, merged once into
    RUN_DIR/init_policy (with a copy of the adapter, which train starts from)."""
    from rlhf_batch.models.load import load_model, load_tokenizer, saved_dtype
    from rlhf_batch.store.atomic import write_dir_atomic
    from rlhf_batch.store.manifests import file_fingerprint
    from rlhf_batch.store.modeldir import check_model_dir

    src = Path(cfg.lora.init_adapter)
    if not (src / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"lora.init_adapter: {src} has no {ADAPTER_WEIGHTS} (a peft LoRA adapter dir)")
    out = layout.init_policy_dir(cfg.run_dir)
    source = {"init_adapter": str(src), "fingerprint": file_fingerprint(src / ADAPTER_WEIGHTS)}
    if out.is_dir():
        made = json.loads((out / INIT_ADAPTER).read_text())
        if made["fingerprint"] != source["fingerprint"]:
            raise StageError(
                f"{out}: made from another adapter ({made['init_adapter']}) than lora.init_adapter "
                f"({src}); use another run_dir"
            )
        return str(out)
    base = str(check_model_dir(cfg.policy_model, "policy_model"))
    model = load_model(
        base, "policy_model", device="cpu", dtype="float32", trust_remote_code=cfg.trust_remote_code
    )

    def write(tmp: Path) -> None:
        try:
            merged = save_adapter(wrap(cfg, model, src), tmp)
        except ConfigError as e:  # an adapter of another model: name the key
            raise ConfigError(f"lora.init_adapter: {e}") from None
        merged.to(saved_dtype(base)).save_pretrained(tmp)
        load_tokenizer(base, cfg.trust_remote_code).save_pretrained(tmp)
        (tmp / INIT_ADAPTER).write_text(json.dumps(source))

    write_dir_atomic(out, write, replace=False)  # another rank may have made it first
    return str(out)
