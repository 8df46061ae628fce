"""Train's loop: the step plan of the epochs, then each optimizer step, with checkpoints, live
tracking and the progress bar, ending in the saved policy (save.py). The trainer is built by
parallel.py; one step's update is step.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_batch.config import Config, TrainConfig
from rlhf_batch.models import checkpoint
from rlhf_batch.observe import tracking
from rlhf_batch.runtime import faults
from rlhf_batch.runtime.progress import Rate
from rlhf_batch.stages.train import carry as train_carry
from rlhf_batch.stages.train import stats as train_stats
from rlhf_batch.stages.train.data import TrainRows
from rlhf_batch.stages.train.parallel import build_trainer
from rlhf_batch.stages.train.save import _checkpoint, _save
from rlhf_batch.store import layout
from rlhf_batch.store.output import StageOutput

if TYPE_CHECKING:
    import numpy as np
from typing import TYPE_CHECKING


@dataclass
class TrainResult:
    """What a finished train run reports in its manifest."""

    rows: list[dict[str, Any]]  # metrics, one per optimizer step
    epochs: int
    sequences: int
    start: str
    world: int
    optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)  # carried state: steps
    fsdp: bool = False  # sharded with FSDP2

    def manifest_extra(self) -> dict[str, Any]:
        counts = {
            "steps": len(self.rows),
            "epochs": self.epochs,
            "sequences": self.sequences,
            "tokens": int(sum(r["tokens"] for r in self.rows)),
        }
        return {
            "rows": len(self.rows),
            "counts": counts,
            "files": [layout.METRICS_FILE, layout.ROLLOUT_STATS_FILE],
            "policy": f"../{layout.POLICY_DIR}",
            "start_policy": self.start,
            "world_size": self.world,
            "fsdp": self.fsdp,
            "optimizer": self.optimizer,
        }


def _train(
    cfg: Config,
    iteration: int,
    start: str,
    out: StageOutput,
    data: TrainRows,
    bar: Any,
    prev: tuple[Path, dict[str, Any]] | None,
    policy: Path,
    schedule_length: Callable[[int], int],
) -> TrainResult:
    import torch

    from rlhf_batch.stages.train.data import plan_steps

    tc = cfg.train
    torch.manual_seed(cfg.seed * 1_000_003 + iteration)
    seed = (cfg.seed % 2**32, iteration)
    steps = plan_steps(
        data.trained_lens,  # the sampled tokens: the normaliser counts no environment token
        data.seq_lens,
        tc.tokens_per_step,
        tc.max_tokens_per_batch,
        tc.ppo_epochs,
        seed,
        tc.max_padding,
        tc.sequences_per_step,
        _active_rows(tc, data),
        data.pairs,  # dpo: a pair's two rows in one micro-batch
    )
    trainer = build_trainer(cfg, start, data, steps)
    if prev is not None:  # the run's AdamW state and step count, as iteration K-1 left them
        train_carry.restore(trainer, prev[0], tc.weight_decay)
    offset, total = int(prev[1]["global_step"]) if prev else 0, schedule_length(len(steps))
    trainer.step_offset, trainer.total_steps = offset, total
    faults.fault_point("train:model-loaded")
    ckpt_dir = out.sdir / layout.CHECKPOINT_DIR
    ckpt = checkpoint.load_latest(
        ckpt_dir, trainer.model, trainer.optimizer, out.key, trainer.device, trainer.sharded
    )
    rows: list[dict[str, Any]] = ckpt["metrics"] if ckpt else []
    trainer.stats = train_stats.RolloutStats(
        ckpt.get("rollout_stats") if ckpt and trainer.rank == 0 else None
    )
    first = ckpt["next_step"] if ckpt else 0
    bar.total, bar.initial, bar.n = len(steps), first, first
    bar.refresh()
    live = tracking.open_run(cfg, iteration)  # live trackers (report_to): one log per optimizer step
    out.clock.work_begins()  # the model, optimizer state and checkpoint are loaded
    seq_lens = data.seq_lens  # [N]
    rate = Rate()  # the bar's tok_s: response tokens over the time since the first step began
    rate.begin()
    for step in steps[first:]:
        rows.append(trainer.step(step))
        mine = [i for mb, weight in step.for_rank(trainer.rank, trainer.world) if weight for i in mb]
        out.clock.add(int(seq_lens[mine].sum()))  # prompt + response tokens this rank trained on
        live.log_step(rows[-1])
        _show(bar, rows[-1], rate.add(rows[-1]["tokens"]))
        done = step.index + 1
        if tc.checkpoint_every and done % tc.checkpoint_every == 0 and done < len(steps):
            per_rollout = trainer.stats.gather(data.rollout_ids, data.trained_lens)
            state = {"key": out.key, "epoch": step.epoch, "metrics": rows, "rollout_stats": per_rollout}
            _checkpoint(trainer, ckpt_dir, done, state)
            trainer.stats = train_stats.RolloutStats(per_rollout)  # the rows so far, once
    bar.close()
    live.close()
    fresh = cfg.train.fresh_optimizer and iteration > 0
    carried = train_carry.record(offset, offset + len(steps), total, iteration - 1 if prev else None, fresh)
    extra = train_carry.state_extra(cfg, offset + len(steps), total, carried["carried_from"])
    per_rollout = trainer.stats.gather(data.rollout_ids, data.trained_lens)
    _save(cfg, out.sdir, policy, trainer, start, rows, extra, per_rollout)
    return TrainResult(rows, tc.ppo_epochs, len(data), start, trainer.world, carried, trainer.sharded)


def _active_rows(tc: TrainConfig, data: TrainRows) -> np.ndarray | None:
    """[N] bool, the rows whose loss gradient can be non-zero, or None (all): with no KL or
    entropy term in the loss, a row of advantage 0 adds exactly 0 to the gradient (its clipped,
    dual-clipped and TIS-weighted objective terms are all multiples of its advantage). SFT: all."""
    if tc.kl_loss_coef or tc.kl_to_inference_coef or tc.entropy_coef or data.objective != "grpo":
        return None
    if data.tok_adv is not None:  # per-token advantages (opd): a row is inactive when all are 0
        import numpy as np

        seen = np.concatenate([[0], np.cumsum(data.tok_adv != 0)])  # [sum T + 1]
        return seen[data.resp_off[1:]] > seen[data.resp_off[:-1]]  # [N] a non-zero token
    return data.adv != 0


def _show(bar: Any, row: dict[str, Any], rate: Rate) -> None:
    def fmt(key: str, spec: str) -> str:  # a step that ran no row has no token means
        return "-" if row[key] is None else format(row[key], spec)

    bar.update(1)
    bar.set_postfix(
        loss=fmt("loss", ".4g"),
        clip=fmt("clip_fraction", ".3f"),
        kl=fmt("kl_approx", ".2e"),
        tok_s=f"{rate:.0f}",
    )
