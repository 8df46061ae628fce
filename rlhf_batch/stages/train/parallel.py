"""The trainer's set-up: the starting policy in train mode (float32 master weights, no dropout),
AdamW over what it trains, then over ranks DistributedDataParallel or FSDP2 (`train.fsdp`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlhf_batch.config import Config
from rlhf_batch.errors import StageError
from rlhf_batch.models import lora
from rlhf_batch.runtime import dist
from rlhf_batch.stages.train.data import TrainRows

if TYPE_CHECKING:
    from rlhf_batch.stages.train.data import Step
    from rlhf_batch.stages.train.step import Trainer
from typing import TYPE_CHECKING


def build_trainer(cfg: Config, start: str, data: TrainRows, steps: list[Step]) -> Trainer:
    """The trainer of `steps`, fully wired: the starting policy (float32, train mode, no dropout),
    its old log-probs recomputed when asked (on the full model), then sharded with FSDP2
    (`train.fsdp` under torchrun) or wrapped in DDP (world > 1), and AdamW over what it trains."""
    import torch

    from rlhf_batch.models.load import load_model, load_tokenizer, own_memory
    from rlhf_batch.runtime.device import resolve_dtype
    from rlhf_batch.stages.train.step import LogProbs, Trainer, _loss_kwargs, recompute_old

    tc, (rank, world) = cfg.train, dist.rank_world()
    device = dist.stage_device(cfg.device)
    base, adapter = lora.train_base(cfg, start)  # with [lora]: the base and the start's adapter
    model = load_model(
        base, "policy", device=device, dtype="float32", trust_remote_code=cfg.trust_remote_code
    )
    tok = load_tokenizer(start, cfg.trust_remote_code)
    data.check_vocabulary(model.get_input_embeddings().num_embeddings, f"{start} (advantages input_ids)")
    _train_mode(model, tc.gradient_checkpointing)
    if cfg.lora.enabled:  # after _train_mode: lora.dropout stays as configured
        model = lora.wrap(cfg, model, adapter)
    bf16 = tc.autocast_bf16 and resolve_dtype(cfg.dtype, device) == torch.bfloat16
    net = LogProbs(model, cfg.generate.temperature, tok.pad_token_id)
    # fused: one kernel per parameter for the whole update (CPU and CUDA), 4x faster than the
    # per-tensor loop torch picks on CPUs; the FSDP optimizer below keeps torch's default
    fused = torch.device(device).type in ("cpu", "cuda")
    trained = lora.trainable(model)
    own_memory(trained)
    optimizer = torch.optim.AdamW(trained, lr=tc.lr, weight_decay=tc.weight_decay, fused=fused)
    trainer = Trainer(
        model, net, optimizer, data, tc, _loss_kwargs(cfg), len(steps), str(device), world, rank, bf16, tok
    )
    # tis_cap weighs the recomputed log-probs against the engine's; SFT and DPO weigh nothing
    if (tc.recompute_old or tc.tis_cap) and data.objective == "grpo":
        recompute_old(trainer, steps)  # on the full model, before it is sharded
    if tc.fsdp and dist.in_group():  # under torchrun, a group of one included
        sharded = _fsdp(model, net, str(device), world)
        # AdamW over the sharded parameters (the one above has no state yet)
        adamw = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
        return dataclasses.replace(trainer, net=sharded, optimizer=adamw, sharded=True)
    if world > 1:
        return dataclasses.replace(trainer, net=_ddp(net, str(device)))
    return trainer


def _train_mode(model: Any, gradient_checkpointing: bool) -> None:
    import torch

    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    model.config.use_cache = False
    if gradient_checkpointing:
        _activation_checkpointing(model, True)


def _activation_checkpointing(model: Any, on: bool) -> None:
    """Recompute each decoder layer in backward (transformers >= 5.x name, else the old one)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs) if on else model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(kwargs) if on else model.gradient_checkpointing_disable()


def _ddp(net: Any, device: str) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    ids = [dist.local_rank()] if device.startswith("cuda") else None
    # buffers (rotary tables) are equal on every rank: synced once at construction, not per forward
    return DistributedDataParallel(net, device_ids=ids, **no_forward_buffer_sync(DistributedDataParallel))


def no_forward_buffer_sync(ddp_class: Any) -> dict[str, Any]:
    """DDP's switch for the per-forward buffer broadcast: `forward_sync_buffers` since torch 2.13
    (which deprecates the old name), `broadcast_buffers` in the older releases pyproject accepts."""
    import inspect

    params = inspect.signature(ddp_class.__init__).parameters
    return (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    )


def _fsdp(model: Any, net: Any, device: str, world: int) -> Any:
    """FSDP2 over all ranks: each decoder layer (the model's `_no_split_modules` classes) is one
    unit; the root unit, holding the embeddings, final norm and LM head, is the LogProbs module,
    whose forward runs the decoder and the chunked LM head."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise StageError(f"train.fsdp: {type(model).__name__} names no decoder layer class to shard")
    mesh = init_device_mesh(torch.device(device).type, (world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)
