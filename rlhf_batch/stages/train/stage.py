"""Stage 4, train: GRPO epochs over iter=K/advantages -> iter=K/policy + iter=K/train.

    iter=K/policy/                      Hugging Face model dir (safetensors) + tokenizer
    iter=K/train/metrics.parquet        one row per optimizer step (schemas.METRICS)
    iter=K/train/_manifest.json         written last: the stage is complete
    iter=K/train/checkpoint/step-N/     while running (every `checkpoint_every` steps); removed at the end
    iter=K/train/optimizer/             the AdamW state iteration K+1 starts from (carry.py)

The policy of iteration K starts from iter=K-1/policy (cfg.policy_model for K = 0); the KL
reference is the stored `ref_logprobs` column, so no reference model is loaded. On an SFT or DPO
iteration (train.objective) the rows are the ones advantage chose (data/selection.py) and the
loss SFT's cross-entropy or DPO's over pairs (step.py); the advantages must have been written for
that objective (their manifest's `objective`), and the manifest records it. With [lora]
(lora.py) it loads the base (`policy_model`) with iteration K-1's adapter instead, trains the
adapter only and writes the adapter into iter=K/policy/adapter next to the merged weights. Dropout is
switched off (as TRL does), so that before the first update the importance ratio is 1.
Master weights are float32; bf16 autocast is used where the config's dtype resolves to
bfloat16 (models.resolve_dtype: a GPU or a CPU with bf16 units). The policy is saved in the
dtype of the starting checkpoint. Killed at any point, a re-run resumes from the last
checkpoint and ends with the weights of an uninterrupted run (CPU float32: bit for bit).

Distributed: `torchrun --nproc-per-node N -m rlhf_batch train CONFIG --iter K`. Every rank
reads the whole advantages table and the ranks split each step's micro-batches (the global
batch per step is the same as on one rank; data.py). DistributedDataParallel averages the
gradients; rank 0 writes checkpoints, the policy and the manifest. The run dir must be on a
filesystem every rank sees. DDP keeps a full copy of the model, gradients and AdamW state on
every rank. With `train.fsdp` (under torchrun, also with N = 1; without torchrun it is a no-op) FSDP2 shards them
instead (`parallel._fsdp`): each rank still loads the full float32 model first (and runs
`recompute_old` on it), then keeps 1/N of it; checkpoints and the policy are full state dicts
gathered on rank 0's CPU (checkpoint.gather), the policy saved through a CPU copy of the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_batch.config import Config
from rlhf_batch.errors import StageError
from rlhf_batch.models import checkpoint, lora
from rlhf_batch.models.policy import start_policy
from rlhf_batch.runtime import dist
from rlhf_batch.stages.base import Stage
from rlhf_batch.stages.train import carry as train_carry
from rlhf_batch.stages.train import schedule as train_schedule
from rlhf_batch.stages.train.data import TrainRows, load_rows
from rlhf_batch.stages.train.loop import TrainResult, _train
from rlhf_batch.stages.train.step import norm_const
from rlhf_batch.store import layout, manifests, retention
from rlhf_batch.store.modeldir import model_fingerprint
from rlhf_batch.store.output import StageOutput

# the objective's keys at these values leave the identity as it was before they existed
OBJECTIVE_DEFAULTS = {
    "ratio_level": "token",
    "seq_eps_low": 3e-4,
    "seq_eps_high": 4e-4,
    "loss": "ppo",
    "cispo_max": 5.0,
    "tis_mode": "truncate",
    "tis_low": 0.0,
}


class Train(Stage):
    """No parts: the policy dir, metrics.parquet and the manifest, with checkpoints meanwhile."""

    name, folder, unit = "train", layout.TRAIN, "step"

    def __init__(self, cfg: Config, iteration: int):
        super().__init__(cfg, iteration)
        self.total_steps: Any  # prepare(): train.total_steps in the identity (train_schedule.py)
        self.adv_dir: Path  # prepare(): the advantages trained on
        self.start: str  # prepare(): the policy the iteration starts from
        self.data: TrainRows | None  # load(): the advantages' rows (None: no trainable row)
        self.prev: tuple[Path, dict[str, Any]] | None  # load(): the optimizer state carried in
        self.changed: dict[str, Any]  # load(): schedule settings that differ from the carried state's
        self.schedule_record: dict[str, Any] | None = None  # the schedule record to write once complete
        self.result: TrainResult  # write_parts(): what the manifest records
        self.objective: str  # prepare(): what train.objective fits in this iteration

    @property
    def progress_desc(self) -> str:
        return f"train iter={self.iteration}"

    def identity(self) -> dict[str, Any]:
        ident = {**super().identity(), "norm_const": norm_const(self.cfg)}
        if not self.cfg.lora.enabled:  # [lora] off: folders written before it existed stay complete
            ident.pop("lora", None)
        if not self.cfg.train.sequences_per_step:  # likewise for steps cut by tokens
            ident["train"].pop("sequences_per_step", None)
        if self.cfg.train.optimizer_state_dtype == "float32":  # likewise for the carried moments
            ident["train"].pop("optimizer_state_dtype", None)
        for key, default in OBJECTIVE_DEFAULTS.items():  # and for the token-level PPO objective
            if ident["train"].get(key) == default:
                ident["train"].pop(key)
        objective = self.cfg.objective(self.iteration)  # train.objective: this iteration's, if not grpo
        if objective != "grpo":
            ident["train"]["objective"] = objective
        if objective == "dpo":
            ident["train"] |= {"dpo_beta": self.cfg.train.dpo_beta, "dpo_loss": self.cfg.train.dpo_loss}
        ident["train"]["total_steps"] = self.total_steps
        return ident

    def prepare(self) -> None:
        cfg, it = self.cfg, self.iteration
        self.total_steps = train_schedule.identity(self.cfg, self.iteration, self.force)
        self.adv_dir = layout.folder(cfg.run_dir, it, layout.ADVANTAGES)
        adv = manifests.manifest(self.adv_dir)
        if adv is None:
            raise StageError(
                f"{self.adv_dir}: advantages are missing or incomplete (no {layout.MANIFEST}); "
                f"run `rlhf-batch advantage --iter {it}` first"
            )
        self.objective = cfg.objective(it)
        if adv.get("objective", "grpo") != self.objective:  # written under another train.objective
            raise StageError(
                f"{self.adv_dir}: advantages were written for objective '{adv.get('objective', 'grpo')}', "
                f"train.objective gives iteration {it} '{self.objective}'; redo them with "
                f"`rlhf-batch advantage --iter {it} --force`"
            )
        self.start = start_policy(cfg, it)
        if it == 0:
            self.fingerprints = {
                "advantages": adv["key"],
                "policy": model_fingerprint(self.start, "policy_model"),
            }
            return
        prev = manifests.manifest(layout.folder(cfg.run_dir, it - 1, layout.TRAIN)) or {}
        # the weights themselves (none: a policy written before they were hashed)
        content = model_fingerprint(self.start, "policy").get("content")
        self.fingerprints = {
            "advantages": adv["key"],
            "policy": prev.get("key"),
            **({"weights": content} if content else {}),
        }

    def load(self) -> None:
        # bad input fails before the folder is marked started; no trainable row: zero steps;
        # null ref_logprobs only without the KL loss
        lora.check_targets(self.cfg)
        _, adapter = lora.train_base(self.cfg, self.start)
        if adapter is not None:  # an adapter of another shape: refused before anything is written
            lora.check_adapter(self.cfg, adapter)
        rows = (manifests.manifest(self.adv_dir) or {}).get("rows")
        need_ref = self.cfg.train.kl_loss_coef > 0 and self.objective == "grpo"
        self.data = load_rows(self.adv_dir, need_ref, self.objective) if rows != 0 else None
        self.prev = train_carry.previous(self.cfg, self.iteration)
        self.changed = train_carry.changes(
            self.cfg, self.iteration, self.prev[1] if self.prev else None, self.force
        )
        if self.prev is not None:
            train_schedule.check_not_ended(self.cfg, self.iteration, self.prev[1]["global_step"], self.force)
        self.schedule_record = None

    def schedule_length(self, steps: int) -> int:
        """The LR schedule's length for this iteration of `steps` steps (train_schedule.py)."""
        carried = self.prev[1].get("total_steps") if self.prev else None
        total, self.schedule_record = train_schedule.length(
            self.cfg, self.iteration, steps, self.force, carried
        )
        return total

    def plan(self) -> int:
        return 0

    def policy_out(self) -> Path:
        """Where this run writes the policy: iter=K/policy, or under --force inside the staging
        folder, from where the commit moves it to iter=K/policy (staging.py)."""
        if self.staging is not None:
            return self.staging / layout.POLICY_DIR
        return layout.policy_dir(self.cfg.run_dir, self.iteration)

    def write_parts(self, todo: list[int], out: StageOutput, bar: Any) -> None:
        if self.data is None:
            from rlhf_batch.stages.train.empty import carry_forward

            carried = carry_forward(
                self.cfg, self.iteration, self.start, self.adv_dir, self.prev, out.sdir, self.policy_out()
            )
            self.result = TrainResult(
                [], self.cfg.train.ppo_epochs, 0, self.start, dist.rank_world()[1], carried
            )
        else:
            self.result = _train(
                self.cfg,
                self.iteration,
                self.start,
                out,
                self.data,
                bar,
                self.prev,
                self.policy_out(),
                self.schedule_length,
            )
        self.result.optimizer["changed"] = self.changed

    def manifest_extra(self) -> dict[str, Any]:
        train_schedule.write(self.cfg, self.schedule_record)  # the run's schedule, fixed or changed
        extra = {**self.result.manifest_extra(), "objective": self.objective}
        if self.data is not None and self.data.pairs is not None:  # dpo: the pairs trained on
            extra["counts"]["pairs"] = len(self.data.pairs)
        return extra

    def on_complete(self) -> None:
        checkpoint.remove(layout.checkpoint_dir(self.cfg.run_dir, self.iteration))
        retention.prune(self.cfg, self.iteration)  # keep_policies: older policies, once this one is complete
