"""An optimizer state dict as safetensors + JSON, keyed by parameter name; nothing is unpickled.

    <dir>/optimizer.safetensors   every tensor of the state: "<parameter name>/<key>"
                                  (AdamW: exp_avg, exp_avg_sq and the step count `step`)
    <dir>/optimizer.json          param_groups (hyper-parameters; `params` as parameter names),
                                  the state's non-tensor values, and the caller's `extra`

Both forms of a state dict are handled: `torch.optim.Optimizer.state_dict()` keys parameters
by index (in `model.parameters()` order, which `names` gives), the full state dict of
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` (FSDP) by name. The files
are always by name, so a state written by one form loads into the other. safetensors holds
tensors only, so loading it runs no code (weights-only by construction).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_batch.errors import StageError
from rlhf_batch.store.layout import OPTIMIZER_META as META
from rlhf_batch.store.layout import OPTIMIZER_TENSORS as TENSORS


def param_names(model: Any) -> list[str]:
    """Names of `model.parameters()`, in that order (the optimizer's parameter indices)."""
    return [n for n, _ in model.named_parameters()]


def _name(key: Any, names: list[str]) -> str:
    return names[key] if isinstance(key, int) else str(key)


def save(
    out: Path,
    state_dict: dict[str, Any],
    names: list[str],
    extra: dict[str, Any],
    moments_dtype: Any = None,
) -> dict[str, Any]:
    """Write `state_dict` into `out` (an existing directory) as TENSORS + META; not atomic by
    itself: callers write into a temporary directory or rename afterwards. `moments_dtype` (a
    torch dtype; None: as they are): the floating-point state other than `step` (AdamW's
    moments) is rounded to it first. Returns the tensors written, by their names in the file, on
    the device they came from."""
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    values: dict[str, dict[str, Any]] = {}
    for key, per_param in state_dict["state"].items():
        name = _name(key, names)
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                moment = moments_dtype is not None and k != "step" and v.is_floating_point()
                tensors[f"{name}/{k}"] = (v.detach().to(moments_dtype) if moment else v.detach()).contiguous()
            else:
                values.setdefault(name, {})[k] = v
    groups = [
        {
            **{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"},
            "params": [_name(p, names) for p in g["params"]],
        }
        for g in state_dict["param_groups"]
    ]
    save_file(to_host(tensors), str(out / TENSORS))
    (out / META).write_text(json.dumps({"param_groups": groups, "values": values, **extra}, indent=1))
    return tensors


def to_host(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` on the CPU with one device-to-host copy per (device, dtype): each such group is
    flattened into one buffer on its device (for the copy, the group's size in device memory),
    copied, and cut into views (AdamW over a 24-layer model: 1 copy instead of ~870, and one
    wait for the device instead of one per tensor). Tensors already on the CPU are not copied."""
    import torch

    groups: dict[tuple[Any, Any], list[str]] = {}
    for k, t in tensors.items():
        groups.setdefault((t.device, t.dtype), []).append(k)
    host = {}
    for (device, _), keys in groups.items():
        if device.type == "cpu":
            host.update({k: tensors[k] for k in keys})
            continue
        flat = torch.cat([tensors[k].reshape(-1) for k in keys]).cpu()
        for k, piece in zip(keys, flat.split([tensors[k].numel() for k in keys]), strict=True):
            host[k] = piece.view(tensors[k].shape)
    return host


def read_meta(out: Path) -> dict[str, Any] | None:
    """The META of `out`, or None when there is none."""
    path = out / META
    if not path.is_file():
        return None
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"{path}: unreadable optimizer state ({e})") from None


def check(out: Path, meta: dict[str, Any]) -> None:
    """One-line errors, before anything is written, for a state that cannot be loaded: a missing or
    unreadable TENSORS file, a `global_step` or `total_steps` that is not a whole number."""
    from safetensors import SafetensorError, safe_open

    for key in ("global_step", "total_steps"):
        value = meta.get(key)
        if key not in meta or (value is None and key == "total_steps"):  # no length: an old state
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StageError(f"{out / META}: '{key}' must be a whole number >= 0, got {value!r}")
    path = out / TENSORS
    try:
        with safe_open(str(path), framework="pt"):  # the header: covers a truncated file
            pass
    except (OSError, SafetensorError) as e:
        raise StageError(f"{path}: unreadable optimizer state ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def load(out: Path, names: list[str], by_name: bool, device: Any = "cpu") -> dict[str, Any]:
    """The state dict saved in `out`, keyed by index into `names` (by_name False: for
    `Optimizer.load_state_dict`) or by name (for FSDP's `set_optimizer_state_dict`)."""
    meta = read_meta(out)
    if meta is None:
        raise StageError(f"{out / META}: optimizer state is missing")
    index = {n: i for i, n in enumerate(names)}
    missing = [n for g in meta["param_groups"] for n in g["params"] if n not in index]
    if missing:
        raise StageError(f"{out}: optimizer state of another model (no parameter {missing[0]!r} here)")

    def key(name: str) -> Any:
        return name if by_name else index[name]

    state: dict[Any, dict[str, Any]] = {}
    for full, tensor in _tensors(out, device).items():
        name, _, k = full.rpartition("/")
        state.setdefault(key(name), {})[k] = tensor
    for name, vals in meta["values"].items():
        state.setdefault(key(name), {}).update(vals)
    groups = [{**g, "params": [key(n) for n in g["params"]]} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _tensors(out: Path, device: Any) -> dict[str, Any]:
    """The tensors of `out`'s TENSORS file: the ones this process kept in memory (resident.py)
    while the files are those it wrote, handed over, else read from the file."""
    from safetensors.torch import load_file

    from rlhf_batch.models import resident

    kept = resident.take_state(out, TENSORS, META)
    if kept is not None:
        return kept
    resident.DISK_READS["optimizer"] += 1
    return load_file(str(out / TENSORS), device=str(device))  # straight to the parameters' device


def keep_written(out: Path, tensors: dict[str, Any]) -> None:
    """`tensors` (what `save` returned) were just written to `out`: keep them in memory when this
    process keeps optimizer states (resident.py)."""
    from rlhf_batch.models import resident

    resident.put_state(out, tensors, TENSORS, META)


def restore(out: Path, model: Any, optimizer: Any, sharded: bool) -> None:
    """Load the state saved in `out` into `optimizer` (over `model`'s parameters); `sharded`:
    they are FSDP-sharded and every rank keeps its shard of the full tensors."""
    names = param_names(model)
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, load(out, names, by_name=True), options=full)
    else:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = load(out, names, by_name=False, device=params[0].device if params else "cpu")
        _check_shapes(out, state, [p for g in optimizer.param_groups for p in g["params"]], names)
        optimizer.load_state_dict(state)


def _check_shapes(out: Path, state: dict[str, Any], params: list[Any], names: list[str]) -> None:
    """Every moment tensor has the shape of the optimizer's parameter it belongs to (a scalar,
    AdamW's step, any)."""
    for i, per_param in state["state"].items():
        for k, v in per_param.items():
            if i < len(params) and getattr(v, "ndim", 0) and tuple(v.shape) != tuple(params[i].shape):
                raise StageError(
                    f"{out / TENSORS}: '{_name(i, names)}/{k}' has shape {list(v.shape)}, its parameter "
                    f"{list(params[i].shape)}: optimizer state of another model"
                )
