"""Stage 4, train: GRPO epochs over iter=K/advantages -> iter=K/policy + iter=K/train.

    iter=K/policy/                      Hugging Face model dir (safetensors) + tokenizer
    iter=K/train/metrics.parquet        one row per optimizer step (schemas.METRICS)
    iter=K/train/_manifest.json         written last: the stage is complete
    iter=K/train/checkpoint/step-N/     while running (every `checkpoint_every` steps); removed at the end

The policy of iteration K starts from iter=K-1/policy (cfg.policy_model for K = 0); the KL
reference is the stored `ref_logprobs` column, so no reference model is loaded. Dropout is
switched off (as TRL does), so that before the first update the importance ratio is 1.
Master weights are float32; bf16 autocast is used where the config's dtype resolves to
bfloat16 (models.resolve_dtype: a GPU or a CPU with bf16 units). The policy is saved in the
dtype of the starting checkpoint. Killed at any point, a re-run resumes from the last
checkpoint and ends with the weights of an uninterrupted run (CPU float32: bit for bit).

Distributed: `torchrun --nproc-per-node N -m rlhf_batch train CONFIG --iter K`. Every rank
reads the whole advantages table and the ranks split each step's micro-batches (the global
batch per step is the same as on one rank; train_data). DistributedDataParallel averages the
gradients; rank 0 writes checkpoints, the policy and the manifest. The run dir must be on a
filesystem every rank sees. DDP keeps a full copy of the model, gradients and AdamW state on
every rank. With `train.fsdp` (and N > 1; on one process it is a no-op) FSDP2 shards them
instead (`_shard`): each rank still loads the full float32 model first (and runs
`recompute_old` on it), then keeps 1/N of it; checkpoints and the policy are full state dicts
gathered on rank 0's CPU (checkpoint.gather), the policy saved through a CPU copy of the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from rlhf_batch import checkpoint, dist, shards
from rlhf_batch.config import Config
from rlhf_batch.errors import StageError
from rlhf_batch.models import check_model_dir, model_fingerprint
from rlhf_batch.stages.train_data import load_shards

METRICS_FILE = "metrics.parquet"
CHECKPOINT_DIR = "checkpoint"


def run(cfg: Config, iteration: int, *, force: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Train iteration `iteration`; returns the manifest (the existing one if already complete)."""
    sdir = shards.stage_dir(cfg.run_dir, iteration, "train")
    adv_dir = shards.stage_dir(cfg.run_dir, iteration, "advantages")
    start, inputs = _inputs(cfg, iteration, adv_dir)
    # read (and check) the shards first: bad input fails before the stage is marked started
    data = load_shards(adv_dir, cfg.train.kl_coef > 0) if force or shards.manifest(sdir) is None else None
    stage = shards.StageRun(sdir, "train", identity(cfg), inputs, force, cfg.to_dict())
    rank, world = dist.rank_world()
    if stage.complete:
        if rank == 0:
            checkpoint.remove(sdir / CHECKPOINT_DIR)  # left by a kill just after the manifest
        return shards.manifest(sdir) or {}
    if force and rank == 0:
        checkpoint.remove(sdir / CHECKPOINT_DIR)
        (sdir / METRICS_FILE).unlink(missing_ok=True)
    dist.barrier()
    data = data if data is not None else load_shards(adv_dir, cfg.train.kl_coef > 0)
    return _train(cfg, iteration, start, stage, data, quiet)


def _inputs(cfg: Config, iteration: int, adv_dir: Path) -> tuple[str, dict[str, Any]]:
    """The starting policy and the fingerprints of what the stage reads."""
    adv = shards.manifest(adv_dir)
    if adv is None:
        raise StageError(
            f"{adv_dir}: advantages are missing or incomplete (no {shards.MANIFEST}); "
            f"run `rlhf-batch advantage --iter {iteration}` first"
        )
    if iteration == 0:
        start = str(check_model_dir(cfg.policy_model, "policy_model"))
        return start, {"advantages": adv["key"], "policy": model_fingerprint(start, "policy_model")}
    prev_dir = shards.stage_dir(cfg.run_dir, iteration - 1, "train")
    prev = shards.manifest(prev_dir)
    if prev is None:
        raise StageError(
            f"{prev_dir}: train of iteration {iteration - 1} is not complete; its policy is the start"
        )
    start = str(check_model_dir(str(shards.policy_dir(cfg.run_dir, iteration - 1)), "policy"))
    return start, {"advantages": adv["key"], "policy": prev["key"]}


def norm_const(cfg: Config) -> float:
    return cfg.train.norm_const or float(cfg.generate.max_new_tokens)


def identity(cfg: Config) -> dict[str, Any]:
    """The config that decides this stage's result (recorded in, and compared with, its manifest)."""
    return {**cfg.stage_dict("train"), "temperature": cfg.generate.temperature, "norm_const": norm_const(cfg)}


def _seed(cfg: Config, iteration: int) -> tuple[int, int]:
    return (cfg.seed % 2**32, iteration)


def _train(cfg: Config, iteration: int, start: str, stage: Any, data: Any, quiet: bool) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from rlhf_batch.stages.train_data import plan_steps
    from rlhf_batch.stages.train_step import recompute_old

    tc = cfg.train
    torch.manual_seed(cfg.seed * 1_000_003 + iteration)
    steps = plan_steps(
        data.resp_lens,
        data.seq_lens,
        tc.tokens_per_step,
        tc.max_tokens_per_batch,
        tc.ppo_epochs,
        _seed(cfg, iteration),
        tc.max_padding,
    )
    trainer, tok = _build(cfg, start, data, len(steps))
    shards.fault_point("train:model-loaded")
    if tc.recompute_old:
        recompute_old(trainer, steps)
    sharded = tc.fsdp and trainer.world > 1
    if sharded:
        _shard(trainer, tc)
    ckpt = checkpoint.load_latest(
        stage.sdir / CHECKPOINT_DIR, trainer.model, trainer.optimizer, stage.key, trainer.device, sharded
    )
    rows: list[dict[str, Any]] = ckpt["metrics"] if ckpt else []
    first = ckpt["next_step"] if ckpt else 0
    if not sharded:
        _wrap_ddp(trainer)
    bar = tqdm(
        total=len(steps),
        initial=first,
        desc=f"train iter={iteration}",
        unit="step",
        file=sys.stderr,
        disable=quiet or trainer.rank != 0,
        dynamic_ncols=True,
    )
    for step in steps[first:]:
        row = trainer.step(step)
        rows.append(row)
        bar.update(1)
        bar.set_postfix(
            loss=f"{row['loss']:.4g}",
            clip=f"{row['clip_fraction']:.3f}",
            kl=f"{row['kl_approx']:.2e}",
            tok_s=f"{row['tokens_per_s']:.0f}",
        )
        done = step.index + 1
        if tc.checkpoint_every and done % tc.checkpoint_every == 0 and done < len(steps):
            full = checkpoint.gather(trainer.model, trainer.optimizer) if sharded else None
            if trainer.rank == 0:
                state = {"key": stage.key, "epoch": step.epoch, "world": trainer.world, "metrics": rows}
                checkpoint.save(
                    stage.sdir / CHECKPOINT_DIR, done, trainer.model, trainer.optimizer, state, full
                )
                shards.fault_point(f"train:checkpoint-{done}")
            dist.barrier()
    bar.close()
    return _finish(cfg, iteration, stage, trainer, tok, start, rows, data, sharded)


def _build(cfg: Config, start: str, data: Any, total_steps: int) -> tuple[Any, Any]:
    """Load the starting policy (float32, train mode, no dropout) and its AdamW optimizer."""
    import torch

    from rlhf_batch.models import load_model, load_tokenizer, resolve_dtype
    from rlhf_batch.stages.train_step import LogProbs, Trainer

    tc, rank, world = cfg.train, *dist.rank_world()
    device = dist.stage_device(cfg.device)
    model = load_model(
        start, "policy", device=device, dtype="float32", trust_remote_code=cfg.trust_remote_code
    )
    tok = load_tokenizer(start, cfg.trust_remote_code)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    model.config.use_cache = False
    if tc.gradient_checkpointing:
        _activation_checkpointing(model, True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    loss_kwargs = {
        "eps_low": tc.eps_low,
        "eps_high": tc.eps_high or tc.eps_low,
        "dual_clip": tc.dual_clip or None,
        "aggregation": tc.aggregation,
        "kl_coef": tc.kl_coef,
        "entropy_coef": tc.entropy_coef,
        "norm_const": norm_const(cfg),
        "kl_to_inference_coef": tc.kl_to_inference_coef,
    }
    bf16 = tc.autocast_bf16 and resolve_dtype(cfg.dtype, device) == torch.bfloat16
    net = LogProbs(model, cfg.generate.temperature, tok.pad_token_id)
    trainer = Trainer(model, net, optimizer, data, tc, loss_kwargs, total_steps, device, world, rank, bf16)
    return trainer, tok


def _activation_checkpointing(model: Any, on: bool) -> None:
    """Recompute each decoder layer in backward (transformers >= 5.x name, else the old one)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs) if on else model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(kwargs) if on else model.gradient_checkpointing_disable()


def _wrap_ddp(trainer: Any) -> None:
    if trainer.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [dist.local_rank()] if str(trainer.device).startswith("cuda") else None
        trainer.net = DistributedDataParallel(trainer.net, device_ids=ids, broadcast_buffers=False)


def _shard(trainer: Any, tc: Any) -> None:
    """FSDP2 over all ranks: each decoder layer (the model's `_no_split_modules` classes) is one
    unit; the root unit, holding the embeddings, final norm and LM head, is the LogProbs module,
    whose forward runs the decoder and the chunked LM head. AdamW is rebuilt over the sharded
    parameters (the one `_build` made has no state yet)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = trainer.model
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise StageError(f"train.fsdp: {type(model).__name__} names no decoder layer class to shard")
    mesh = init_device_mesh(torch.device(trainer.device).type, (trainer.world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer.net, mesh=mesh)
    # gradients are reduce-scattered after every micro-batch: keeping them unsharded until the
    # step's last one, as DDP's no_sync does, would hold full gradients on every rank
    trainer.net.no_sync = contextlib.nullcontext
    trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)


def _unsharded(cfg: Config, start: str, weights: dict[str, Any]) -> Any:
    """Rank 0: a CPU copy of the policy holding the gathered full weights, for save_pretrained."""
    from rlhf_batch.models import load_model

    model = load_model(
        start, "policy", device="cpu", dtype="float32", trust_remote_code=cfg.trust_remote_code
    )
    model.load_state_dict(weights)
    return model


def _saved_dtype(start: str) -> Any:
    import torch

    raw = json.loads((Path(start) / "config.json").read_text())
    name = raw.get("dtype") or raw.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def _write_policy(model: Any, tok: Any, out: Path, dtype: Any, gradient_checkpointing: bool) -> None:
    """save_pretrained + tokenizer into a hidden temp dir, then rename to `out`."""
    from safetensors import SafetensorError

    for stale in out.parent.glob(".policy.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(f".policy.tmp-{os.getpid()}")
    model.config.use_cache = True
    if gradient_checkpointing:
        _activation_checkpointing(model, False)
    try:
        model.eval().to(dtype).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        checkpoint.fsync_tree(tmp)
    except (OSError, SafetensorError) as e:  # a full disk, as each writer reports it
        shutil.rmtree(tmp, ignore_errors=True)
        raise shards.write_error(out, e) from e
    shards.fault_point("train:policy:tmp")
    if out.exists():  # from a run killed after its rename but before the manifest
        shutil.rmtree(out)
    os.replace(tmp, out)


def _finish(
    cfg: Config,
    iteration: int,
    stage: Any,
    trainer: Any,
    tok: Any,
    start: str,
    rows: list[dict[str, Any]],
    data: Any,
    sharded: bool,
) -> dict[str, Any]:
    """Rank 0: the policy, then metrics.parquet, then the manifest (last); drop the checkpoints."""
    import pyarrow as pa

    from rlhf_batch.schemas import METRICS

    dist.barrier()
    weights = checkpoint.gather(trainer.model)[0] if sharded else None
    if trainer.rank == 0:
        out = shards.policy_dir(cfg.run_dir, iteration)
        model = trainer.model if weights is None else _unsharded(cfg, start, weights)
        checkpointing = cfg.train.gradient_checkpointing and weights is None
        _write_policy(model, tok, out, _saved_dtype(start), checkpointing)
        table = pa.Table.from_pylist([{k: r[k] for k in METRICS.names} for r in rows], schema=METRICS)
        shards.write_parquet_atomic(stage.sdir / METRICS_FILE, table, METRICS)
    counts = {
        "steps": len(rows),
        "epochs": cfg.train.ppo_epochs,
        "sequences": len(data),
        "tokens": int(sum(r["tokens"] for r in rows)),
    }
    extra = {
        "rows": len(rows),
        "counts": counts,
        "files": [METRICS_FILE],
        "policy": "../policy",
        "start_policy": start,
        "world_size": trainer.world,
    }
    result = stage.finish(0, extra)
    shards.fault_point("train:manifest:done")
    if trainer.rank == 0:
        checkpoint.remove(stage.sdir / CHECKPOINT_DIR)
    return result or shards.manifest(stage.sdir) or {}
