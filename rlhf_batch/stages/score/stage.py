"""The score stage: ``iter=K/rollouts`` -> ``iter=K/scores``, one row per rollout, rollouts order.

Columns (``schemas.SCORES`` plus extras):

* ``reward_<name>`` per reward function and ``rm_score`` for the reward model (float64, null
  when the function returned None); ``reward_raw`` = their weighted sum (null when any is null);
  ``score`` = ``reward_raw`` clipped to ``[-score_clip, score_clip]`` (``score_clip`` 0: no clip).
* ``ref_logprobs`` per response token: log_softmax(logits / ``generate.temperature``) of the
  reference model (``ref_model``, default the initial policy), the function generate uses.
* ``kl`` per token with ``score.kl_estimator`` (k1 = behaviour - reference), ``kl_sum`` its sum
  (float64), ``kl_coef`` the beta used (0 when ``kl_in_reward`` is off) and
  ``reward = score - kl_coef * kl_sum`` (null when ``score`` is null; counted as ``unscored``).

No KL, no reference: when KL is used neither in the reward (``kl_in_reward`` off or
``kl_reward_coef`` 0) nor in the loss (``train.kl_loss_coef`` 0), ``ref_logprobs``, ``kl`` and
``kl_sum`` are null, ``kl_coef`` is 0 and ``reward = score``; the reference model is not loaded, so
reward functions alone cost no model forward (the reference's config and tokenizer are still
read to check the rollouts' token ids). train's ``kl_to_ref`` metric is then 0.

Reference == policy: when a rollout's ``policy`` column names the reference model's directory
(or a policy train carried forward unchanged from it: checks.origin),
its reference log-probs ARE its behaviour log-probs (same weights, same log-prob definition), so
they are copied instead of recomputed: ``kl`` is exactly 0 and no reference forward runs. Any
other rollout gets a full forward pass of the reference; a copy of the policy under another
path then gives |kl| ~1e-6 (rounding of KV-cached sampling vs one full forward).

KL coefficient: the constant controller always uses ``score.kl_reward_coef``. The adaptive one starts
from it at iteration 0; iteration K uses the state that iteration K-1 left in its manifest
(``iter=K-1/scores/_manifest.json`` "kl_controller"), so a re-run sees the same beta. After
scoring, the controller is updated with this iteration's mean ``kl_sum`` and number of rollouts
and the new state is written to this manifest. Parts: part n holds rollouts rows
``[n * R, (n + 1) * R)`` with R = ``score.rows_per_part``; fanned out over N processes (or N
torchrun ranks), R = min(``score.rows_per_part``, ceil(rows / N)), so that every rank has a part
(recorded as the input ``part_rows`` when it differs; a process that finds the folder started,
or complete, takes its R, so ranks and later runs of any world size agree on the parts). ``score.max_tokens_per_batch`` is not
part of the stage's identity (it changes no result beyond rounding), so an interrupted run can
be resumed with a smaller budget.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlhf_batch.config import Config, reward_search_path
from rlhf_batch.core.kl import (
    KLController,
    controller_from_state,
    make_controller,
)
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.rewards import (
    RewardFunction,
    load_reward_functions,
)
from rlhf_batch.rewards.conventions import check_arguments
from rlhf_batch.runtime import dist
from rlhf_batch.stages.base import Part, Stage, list_tokens
from rlhf_batch.stages.score.checks import (
    same_model,
)
from rlhf_batch.stages.score.scorer import Scorer, kl_used, reward_parts
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.manifests import manifest, read_complete
from rlhf_batch.store.modeldir import check_base_weights, model_fingerprint
from rlhf_batch.store.schemas import ROLLOUTS, SCORES


class Score(Stage):
    name, folder, unit, unit_scale = "score", layout.SCORES, "tok", True

    def __init__(self, cfg: Config, iteration: int, topup: int = 0):
        super().__init__(cfg, iteration, topup)
        self.fns: list[RewardFunction]  # prepare(): the reward functions
        self.rdir: Path  # prepare(): the rollouts scored
        self.rollouts_manifest: dict[str, Any]  # prepare(): their manifest
        self.ctl: KLController  # prepare(): the KL controller whose value is this iteration's beta
        self.kl_coef: float  # prepare(): beta in the reward (0 without KL in the reward)
        self.part_rows: int  # prepare(): rows per part
        self.rollouts: pa.Table  # open(): the rollouts
        self.scorer: Scorer  # open(): the models and reward functions that score a part

    def identity(self) -> dict[str, Any]:
        ident = {**super().identity(), "ref_model": self.cfg.ref, "ref_logprobs": kl_used(self.cfg)}
        if not self.cfg.score.teacher_model:  # no teacher: folders written before the key stay complete
            ident["score"].pop("teacher_model", None)
        if not self.cfg.score.judge_model:  # no judge: likewise for its keys
            ident["score"] = {k: v for k, v in ident["score"].items() if not k.startswith("judge_")}
        return ident

    def prepare(self) -> None:
        cfg, it = self.cfg, self.iteration
        self._load_reward_functions()  # a config without any reward fails before anything is read
        self.rdir = layout.folder(cfg.run_dir, it, layout.ROLLOUTS, self.topup)
        rollouts_manifest = manifest(self.rdir)
        if rollouts_manifest is None:
            raise StageError(
                f"{self.rdir}: rollouts are not complete; run generate (or import) for iteration {it}"
            )
        self.rollouts_manifest = rollouts_manifest
        check_base_weights(cfg.run_dir, cfg.ref, "ref_model")
        self.ctl = kl_controller_for(cfg, it)
        self.kl_coef = self.ctl.value if cfg.score.kl_in_reward else 0.0
        self.part_rows = part_rows(self.sdir, cfg.score.rows_per_part, rollouts_manifest["rows"], self.force)
        sized = {"part_rows": self.part_rows} if self.part_rows != cfg.score.rows_per_part else {}
        self.fingerprints = {
            "rollouts": {k: self.rollouts_manifest[k] for k in ("key", "rows")},
            "ref_model": model_fingerprint(cfg.ref, "ref_model"),
            "reward_model": model_fingerprint(cfg.reward_model, "reward_model") if cfg.reward_model else None,
            **teacher_input(cfg),
            "kl_controller": self.ctl.state_dict(),
            "kl_coef": self.kl_coef,
            **sized,
        }

    def _load_reward_functions(self) -> None:
        s = self.cfg.score
        self.fns = load_reward_functions(
            s.reward_functions, s.reward_weights, SCORES.names, reward_search_path(self.cfg)
        )
        if not self.fns and not self.cfg.reward_model and not self.cfg.score.judge_model:
            raise ConfigError(
                "score: set score.reward_functions, reward_model and/or score.judge_model; "
                "nothing would give a reward"
            )

    def plan(self) -> int:
        return math.ceil(self.rollouts_manifest["rows"] / self.part_rows)

    def open(self, todo: list[int]) -> None:
        self.rollouts = read_complete(self.rdir, ROLLOUTS)
        carried = [c for c in self.rollouts.column_names if c not in ROLLOUTS.names]
        check_arguments(self.fns, carried, str(self.rdir))  # before any rollout is scored
        if self.cfg.score.judge_model:
            from rlhf_batch.core.verdicts import template_problem

            if problem := template_problem(
                self.cfg.score.judge_template or "", self.cfg.score.judge_mode, carried
            ):
                raise ConfigError(f"{self.rdir}: {problem}")
        stored = pc.unique(self.rollouts["policy"].drop_null()).to_pylist()
        policies = [layout.from_run(p, self.cfg.run_dir) for p in stored]  # relative: inside the run
        self.scorer = Scorer(self.cfg, policies, self.fns, self.kl_coef)
        if self.scorer.kl and not all(same_model(p, self.cfg.ref) for p in policies):
            self.scorer.ref_model  # noqa: B018 - loaded in start-up, not in the first part's time

    def progress_total(self, todo: list[int]) -> int:
        if not todo:  # every part is on disk: only the manifest is missing
            return 0
        rows, t = self.part_rows, self.rollouts
        lengths = pc.add(pc.list_value_length(t["prompt_ids"]), pc.list_value_length(t["response_ids"]))
        total = sum(int(pc.sum(lengths.slice(n * rows, rows)).as_py() or 0) for n in todo)
        # the reward model and the teacher read every token once more
        return total * (1 + bool(self.cfg.reward_model) + bool(self.cfg.score.teacher_model))

    def write_part(self, n: int, bar: Any) -> Part:
        rows = self.part_rows
        part = self.rollouts.slice(n * rows, rows)
        where = f"{self.rdir} (rows {n * rows}..{n * rows + part.num_rows - 1})"
        table, counts = self.scorer.score_part(part, where, bar.update)
        counts.update(self.scorer.calls.take_counts())  # the reward cache's hits and misses
        return Part(table, table.schema, counts, list_tokens(part, "prompt_ids", "response_ids"))

    def manifest_extra(self) -> dict[str, Any]:
        extra = (
            controller_extra(self.sdir, self.plan(), self.ctl, self.kl_coef)
            if kl_used(self.cfg)
            else {"kl_coef": 0.0, "mean_kl_sum": None, "kl_controller": self.ctl.state_dict()}
        )
        # the parts of reward_raw and their weights (advantage.reward_normalization = "per_part")
        parts = reward_parts(self.cfg, self.fns)
        return {**extra, "max_tokens_per_batch": self.cfg.score.max_tokens_per_batch, "reward_parts": parts}


def teacher_input(cfg: Config) -> dict[str, Any]:
    """The teacher's and the judge's fingerprints among score's inputs (none without them, as before)."""
    out = {}
    for key in ("teacher_model", "judge_model"):
        if path := getattr(cfg.score, key):
            out[key] = model_fingerprint(path, f"score.{key}")
    return out


def part_rows(sdir: Path, configured: int, rows: int, force: bool) -> int:
    """The rows of a score part: the size the folder was started with (its `_started.json` or
    manifest: ranks and re-runs of any world size agree), else `score.rows_per_part`, fanned out
    over N ranks at most ceil(rows / N) (a rank without a part would idle)."""
    if not force:
        for name in (layout.MANIFEST, layout.STARTED):
            if (sdir / name).exists():
                recorded = manifests.read_json(sdir / name)
                return int((recorded.get("inputs") or {}).get("part_rows", configured))
    world = dist.rank_world()[1]
    return min(configured, max(1, math.ceil(rows / world))) if world > 1 else configured


def kl_controller_for(cfg: Config, iteration: int) -> KLController:
    """The controller whose value is this iteration's beta (see the module docstring)."""
    s = cfg.score
    ctl = make_controller(s.kl_controller, s.kl_reward_coef, s.kl_target, s.kl_horizon)
    if s.kl_controller == "constant" or iteration == 0:
        return ctl
    prev = layout.folder(cfg.run_dir, iteration - 1, layout.SCORES)
    m = manifest(prev)
    if m is None:
        raise StageError(
            f"{prev}: not complete; the adaptive KL controller carries its state from "
            f"iteration {iteration - 1}'s scores, so score that iteration first"
        )
    state = m.get("kl_controller") or {}
    if state.get("kind") == "adaptive":  # target and horizon come from the current config
        return controller_from_state({**ctl.state_dict(), "beta": float(state["beta"])})
    return ctl


def controller_extra(sdir: Path, n_parts: int, ctl: KLController, kl_coef: float) -> dict[str, Any]:
    """Manifest entries: beta used, mean kl_sum over all rows, controller state after the update."""
    first: dict[int, Path] = {}
    for p in layout.list_parts(sdir):
        first.setdefault(layout.part_number(p), p)
    sums = [
        manifests.read_table(first[n], columns=["kl_sum"])["kl_sum"].to_numpy()
        for n in range(n_parts)
        if n in first
    ]
    kl_sums = np.concatenate(sums) if sums else np.zeros(0)  # [rows]
    mean_kl = float(kl_sums.mean()) if kl_sums.size else 0.0
    after = controller_from_state(ctl.state_dict())
    after.update(mean_kl, int(kl_sums.size))
    return {"kl_coef": kl_coef, "mean_kl_sum": mean_kl, "kl_controller": after.state_dict()}
