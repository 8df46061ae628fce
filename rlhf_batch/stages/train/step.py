"""One GRPO optimizer step over a step's micro-batches, under DDP or not; old log-probs recompute.

Per step: the global normaliser (response tokens, or sequences for the seq_mean_* variants)
is known from the lengths before any backward pass and is passed to `grpo_loss` as
`denominator`, so the summed micro-batch losses equal the loss of one big batch however the
step is split into micro-batches and ranks. DDP averages gradients over ranks, so each rank
back-propagates `world * loss`. Gradients are synchronised only on the last micro-batch.

Metrics per step: the loss terms are summed over micro-batches and ranks (they already carry
the global normaliser); clip_fraction, kl_approx, kl_to_ref, entropy and ratio_mean are
token-weighted means, i.e. the masked means over all the step's real tokens (the entropy, when
`entropy_coef` is 0 and it is only a metric: over the step's first micro-batch, the only one that
computes it); ess is computed once over all the step's sequences (from their log importance
weights, on every rank). A micro-batch reads nothing back from the device: the metrics are summed
there and read once a step.

The loss is `core.losses.grpo_loss` (its per-token objectives: core/objectives.py), called with
the config's settings as `_loss_kwargs` (the end of this module) gives them. On an SFT or DPO
iteration (train.objective) it is `core.supervised.sft_loss` over the step's trained tokens, or
`dpo_loss` over the step's pairs (`train.dpo_beta`, `train.dpo_loss`), reading the stored
reference log-probs; the clip, KL, entropy and importance-sampling settings are GRPO's and do
not apply there (a rank's weight-0 filler row of a DPO step runs `sft_loss`, times 0).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_batch.config import Config, TrainConfig
from rlhf_batch.core.losses import grpo_loss
from rlhf_batch.core.supervised import dpo_loss, sft_loss
from rlhf_batch.errors import StageError
from rlhf_batch.models.forward import padded_logprobs
from rlhf_batch.stages.train.data import Step, TrainRows, lr_factor, micro_batch

LOSSES = ("loss", "loss_objective", "loss_kl_to_ref", "loss_kl_to_inference", "loss_entropy")
TOKEN_MEANS = ("clip_fraction", "kl_approx", "kl_to_ref", "entropy", "ratio_mean", "tis_masked")


class LogProbs(torch.nn.Module):
    """The policy as DDP sees it: (ids [B, L], select [N], place [N], mask [B, T]) -> (logp,
    entropy or None) [B, T] (`forward.padded_logprobs`)."""

    def __init__(self, model: Any, temperature: float, pad_id: int):
        super().__init__()
        self.model, self.temperature, self.pad_id = model, temperature, pad_id

    def forward(
        self,
        ids: torch.Tensor,
        select: torch.Tensor,
        place: torch.Tensor,
        mask: torch.Tensor,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return padded_logprobs(  # type: ignore[no-any-return]
            self.model, ids, select, place, mask.shape[1], self.temperature, with_entropy=with_entropy
        )


def _all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    import torch.distributed as td

    if td.is_available() and td.is_initialized() and td.get_world_size() > 1:
        td.all_reduce(x, op=td.ReduceOp.MAX if op == "max" else td.ReduceOp.SUM)
    return x


class StepMetrics:
    """Sums of one step's micro-batch metrics on this rank; `reduce` combines all ranks."""

    def __init__(self, device: Any):
        # the loss terms, the token means' sums, the entropy's tokens, the tokens
        self.sums = torch.zeros(len(LOSSES) + len(TOKEN_MEANS) + 2, dtype=torch.float64, device=device)
        self.log_w: list[torch.Tensor] = []
        self.has_tokens: list[torch.Tensor] = []
        self.tokens_run = 0  # response tokens that ran, all ranks (set by `reduce`)

    def add(
        self,
        out: Any,
        mask: torch.Tensor,
        logp: torch.Tensor,
        old: torch.Tensor,
        weight: float,
        entropy: bool = True,
    ) -> None:
        """One micro-batch's metrics, on the device (read once a step, by `reduce`); `entropy`:
        whether its entropy was computed (its tokens count towards the entropy's mean)."""
        n = mask.sum().double() * weight  # []
        losses = [getattr(out, k).detach().double() * weight for k in LOSSES]
        means = [getattr(out, k).double() * (n if k != "entropy" or entropy else 0.0) for k in TOKEN_MEANS]
        self.sums += torch.stack([*losses, *means, n if entropy else n.new_zeros(()), n])  # [K]
        if weight:
            self.log_w.append(torch.where(mask, logp.detach() - old, 0.0).sum(-1))  # [B]
            self.has_tokens.append(mask.any(-1))  # [B]

    def reduce(self) -> dict[str, float | None]:
        """The step's metrics over all ranks; token means and ESS are None when no token ran."""
        sums = _all_reduce(self.sums).tolist()
        self.tokens_run = int(sums[-1])
        out: dict[str, float | None] = dict(zip(LOSSES, sums[: len(LOSSES)], strict=True))
        means, counts = (
            sums[len(LOSSES) : -2],
            dict(zip(TOKEN_MEANS, [sums[-1]] * len(TOKEN_MEANS), strict=True)),
        )
        counts["entropy"] = sums[-2]  # the tokens whose entropy was computed (Trainer.step)
        out.update({k: v / counts[k] if counts[k] else None for k, v in zip(TOKEN_MEANS, means, strict=True)})
        out["ess"] = self._ess()
        return out

    def _ess(self) -> float | None:
        """(sum w)^2 / (n sum w^2) over the step's sequences, w = exp(log_w), shifted by the max."""
        log_w = (
            torch.cat(self.log_w)[torch.cat(self.has_tokens)].double()
            if self.log_w
            else self.sums.new_zeros(0)
        )  # [n]
        top = log_w.max() if len(log_w) else self.sums.new_tensor(-1e300)  # []
        top = _all_reduce(top.clone(), "max")
        w = torch.exp(log_w - top)  # [n], <= 1
        s1, s2, n = _all_reduce(torch.stack([w.sum(), (w * w).sum(), w.new_tensor(len(w))])).tolist()
        return s1 * s1 / (n * s2) if n else None


@dataclass
class Trainer:
    """Built by `parallel.build_trainer`, fully wired: `net` is already wrapped in DDP (world > 1) or
    sharded with FSDP2 (`sharded`), and `optimizer` holds the parameters `net` trains."""

    model: torch.nn.Module  # the Hugging Face model (float32 master weights)
    net: torch.nn.Module  # LogProbs(model), wrapped in DDP or sharded
    optimizer: torch.optim.Optimizer
    data: TrainRows
    tcfg: TrainConfig
    loss_kwargs: dict[str, Any]
    total_steps: int  # optimizer steps of the whole run (the lr schedule's length)
    device: str
    world: int
    rank: int
    bf16: bool
    tokenizer: Any  # the policy's tokenizer, saved with it
    sharded: bool = False
    step_offset: int = 0  # optimizer steps the run took before this stage (carried AdamW state)
    stats: Any = None  # stats.RolloutStats: the per-rollout diagnostics, when collected

    def _accumulate(self, last: bool) -> Any:
        """DDP: no gradient sync before the step's last micro-batch. FSDP reduce-scatters after
        every micro-batch: keeping gradients unsharded until the last one, as DDP's no_sync
        does, would hold full gradients on every rank."""
        if last or self.world == 1 or self.sharded:
            return contextlib.nullcontext()
        return self.net.no_sync()  # type: ignore[operator]

    def forward(self, td: Any, with_entropy: bool = True) -> tuple[torch.Tensor, Any, Any]:
        """A micro-batch (`micro_batch`) -> logp [B, T] float32, mask [B, T], entropy [B, T]
        float32 (None without `with_entropy`)."""
        mask = td["mask"]
        with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.bf16):
            logp, ent = self.net(
                td["input_ids"], td["select"], td["place"], mask, with_entropy
            )  # [B, T] each
        return logp.float(), mask, (ent.float() if ent is not None else None)

    def _step_casts(self) -> Any:
        """A context around a whole step that keeps autocast's bf16 copies of the weights: autocast
        drops them when its outermost context exits, enabled or not, so each weight is cast once a
        step, not once a micro-batch (weights change only in the optimizer step, after it). This
        outer context is disabled: the loss and backward run outside autocast as before. FSDP
        gathers and frees its parameters around every micro-batch: there each forward casts anew."""
        if self.sharded or not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, enabled=False)

    def _supervised_loss(
        self, td: Any, logp: torch.Tensor, mask: torch.Tensor, ent: Any, denominator: float, weight: float
    ) -> Any:
        """SFT's or DPO's loss of a micro-batch (a DPO micro-batch holds whole pairs; a filler
        row of weight 0 runs SFT's, whose gradient the weight zeroes)."""
        ref = td.get("ref_logprobs", None)
        ent = ent.detach() if ent is not None else None
        if self.data.objective == "sft" or not weight:
            return sft_loss(
                logp, td["old_logprobs"], mask, ref_logprobs=ref, entropy=ent, denominator=denominator
            )
        tc = self.tcfg
        return dpo_loss(
            logp,
            td["old_logprobs"],
            ref,
            mask,
            beta=tc.dpo_beta,
            loss_type=tc.dpo_loss,
            entropy=ent,
            denominator=denominator,
        )

    def step(self, step: Step) -> dict[str, Any]:
        """Run one optimizer step; returns its metrics row (schemas.METRICS)."""
        t0 = time.perf_counter()
        tc, objective = self.tcfg, self.data.objective
        denominator = float(max(1, step.tokens if tc.aggregation == "token_mean" else step.sequences))
        if objective == "sft":  # the step's trained tokens
            denominator = float(max(1, step.tokens))
        elif objective == "dpo":  # the step's pairs
            denominator = float(max(1, sum(len(mb) for mb in step.micro) // 2))
        metrics = StepMetrics(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        work = step.for_rank(self.rank, self.world)
        with self._step_casts():
            for j, (rows, weight) in enumerate(work):
                td = micro_batch(self.data, rows, self.device)
                # the entropy: for the loss when it has a term, else for the metric, sampled from
                # the step's first micro-batch (rank 0's first, whatever the number of ranks)
                entropy = bool(tc.entropy_coef and objective == "grpo") or (
                    self.rank == 0 and j == 0 and weight > 0
                )
                with self._accumulate(j == len(work) - 1):
                    logp, mask, ent = self.forward(td, entropy)  # [B, T] each
                    if objective == "grpo":
                        out = grpo_loss(
                            logp,
                            td["old_logprobs"],
                            td["advantages"],
                            mask,
                            ref_logprobs=td.get("ref_logprobs", None),
                            entropy=ent if tc.entropy_coef or ent is None else ent.detach(),
                            denominator=denominator,
                            behavior_logprobs=td.get("behavior_logprobs", None),
                            **self.loss_kwargs,
                        )
                    else:
                        out = self._supervised_loss(td, logp, mask, ent, denominator, weight)
                    (out.loss * (weight * self.world)).backward()  # type: ignore[no-untyped-call]
                metrics.add(out, mask, logp, td["old_logprobs"], weight, entropy)
                if self.stats is not None and weight:
                    self.stats.add(rows, step.epoch, step.index, out.row_stats)
        if not work:  # no row of the step can move the loss (data.py): AdamW steps on zeros
            # (every trainable parameter: one that its rows would have left without a gradient,
            # a mixture-of-experts expert no token reached, takes this step too)
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        max_norm = tc.max_grad_norm if tc.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not math.isfinite(grad_norm):
            raise StageError(
                f"train step {step.index}: gradient norm is {grad_norm}; lower train.lr or check the advantages"
            )
        lr = tc.lr * lr_factor(
            self.step_offset + step.index, self.total_steps, tc.warmup_steps, tc.lr_schedule
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        row = metrics.reduce()
        seconds = time.perf_counter() - t0
        row.update(
            step=step.index,
            epoch=step.epoch,
            lr=lr,
            grad_norm=grad_norm,
            tokens=step.tokens,
            sequences=step.sequences,
            tokens_per_s=metrics.tokens_run / max(seconds, 1e-9),  # the response tokens that ran
        )
        return row


@torch.no_grad()
def recompute_old(trainer: Trainer, steps: list[Step]) -> None:
    """Replace the behaviour log-probs by the current policy's (before the first update).
    Rows the plan does not run (data.py: `active`) are not computed; theirs are left at 0.

    Each rank computes the epoch-0 micro-batches it owns (together they cover every row once)
    into a flat [sum T] buffer; a sum over ranks gives every rank all of them.
    """
    data = trainer.data
    flat = torch.zeros(len(data.old), dtype=torch.float32, device=trainer.device)  # [sum T]
    for step in (s for s in steps if s.epoch == 0):
        for rows, weight in step.for_rank(trainer.rank, trainer.world):
            if not weight:
                continue
            td = micro_batch(data, rows, trainer.device)
            logp, _, _ = trainer.forward(td, with_entropy=False)  # [B, T]
            at = np.concatenate([np.arange(data.resp_off[i], data.resp_off[i + 1]) for i in rows])  # [N]
            flat.index_copy_(
                0, torch.from_numpy(at).to(flat.device), logp.view(-1).index_select(0, td["place"])
            )
    data.behavior = data.old  # what truncated importance sampling weighs against
    data.old = _all_reduce(flat).cpu().numpy()


def norm_const(cfg: Config) -> float:
    return cfg.train.norm_const or float(cfg.generate.max_new_tokens)


def _loss_kwargs(cfg: Config) -> dict[str, Any]:
    tc = cfg.train
    return {
        "eps_low": tc.eps_low,
        "eps_high": tc.eps_high or tc.eps_low,
        "dual_clip": tc.dual_clip or None,
        "aggregation": tc.aggregation,
        "kl_coef": tc.kl_loss_coef,
        "entropy_coef": tc.entropy_coef,
        "norm_const": norm_const(cfg),
        "kl_to_inference_coef": tc.kl_to_inference_coef,
        "tis_cap": tc.tis_cap,
        "ratio_level": tc.ratio_level,
        "loss_type": tc.loss,
        "cispo_max": tc.cispo_max,
        "tis_mode": tc.tis_mode,
        "tis_low": tc.tis_low,
        **(
            {"eps_low": tc.seq_eps_low, "eps_high": tc.seq_eps_high or tc.seq_eps_low}
            if tc.ratio_level == "sequence"
            else {}
        ),
    }
