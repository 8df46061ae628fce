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
``kl_coef`` 0) nor in the loss (``train.kl_coef`` 0), ``ref_logprobs``, ``kl`` and ``kl_sum``
are null, ``kl_coef`` is 0 and ``reward = score``; the reference model is not loaded, so
reward functions alone cost no model forward (the reference's config and tokenizer are still
read to check the rollouts' token ids). train's ``kl_to_ref`` metric is then 0.

Reference == policy: when a rollout's ``policy`` column names the reference model's directory,
its reference log-probs ARE its behaviour log-probs (same weights, same log-prob definition), so
they are copied instead of recomputed: ``kl`` is exactly 0 and no reference forward runs. Any
other rollout gets a full forward pass of the reference; a copy of the policy under another
path then gives |kl| ~1e-6 (rounding of KV-cached sampling vs one full forward).

KL coefficient: the constant controller always uses ``score.kl_coef``. The adaptive one starts
from it at iteration 0; iteration K uses the state that iteration K-1 left in its manifest
(``iter=K-1/scores/_manifest.json`` "kl_controller"), so a re-run sees the same beta. After
scoring, the controller is updated with this iteration's mean ``kl_sum`` and number of rollouts
and the new state is written to this manifest. Parts: part n holds rollouts rows
``[n * R, (n + 1) * R)`` with R = ``score.rows_per_part``. ``score.max_tokens_per_batch`` is not
part of the stage's identity (it changes no result beyond rounding), so an interrupted run can
be resumed with a smaller budget.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from rlhf_batch import dist
from rlhf_batch.config import Config
from rlhf_batch.core.batching import token_budget_batches
from rlhf_batch.core.kl import KLController, controller_from_state, kl_estimate, make_controller
from rlhf_batch.errors import ConfigError, StageError
from rlhf_batch.forward import can_share_prefix, response_logprobs, shared_prefix_logprobs
from rlhf_batch.models import load_model, model_fingerprint
from rlhf_batch.rewards import (
    RM_COLUMN,
    RewardFunction,
    call_reward_function,
    clip,
    load_reward_functions,
    weighted_sum,
)
from rlhf_batch.schemas import ROLLOUTS, SCORES, with_extra
from rlhf_batch.shards import StageRun, fault_point, list_parts, manifest, part_number, read_stage, stage_dir
from rlhf_batch.stages.score_checks import check_rollouts, check_tokenizers, config_vocab_size, same_dir


def identity(cfg: Config) -> dict[str, Any]:
    """The config that decides this stage's result (recorded in, and compared with, its manifest).
    The token budget changes no result (up to rounding): a resume may lower it after an OOM."""
    return {
        "score": {k: v for k, v in dataclasses.asdict(cfg.score).items() if k != "max_tokens_per_batch"},
        "ref_model": cfg.ref,
        "reward_model": cfg.reward_model,
        "temperature": cfg.generate.temperature,
        "dtype": cfg.dtype,
        "ref_logprobs": kl_used(cfg),
    }


def kl_used(cfg: Config) -> bool:
    """KL to the reference enters the reward or the loss, so score computes reference log-probs."""
    s = cfg.score
    return (s.kl_in_reward and s.kl_coef > 0) or cfg.train.kl_coef > 0


def run(cfg: Config, iteration: int, *, force: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Score iteration `iteration`'s rollouts; returns the manifest (existing one if complete)."""
    s = cfg.score
    fns = load_reward_functions(s.reward_functions, s.reward_weights, reserved=SCORES.names)
    if not fns and not cfg.reward_model:
        raise ConfigError(
            "score: set score.reward_functions and/or reward_model; nothing would give a reward"
        )
    rdir = stage_dir(cfg.run_dir, iteration, "rollouts")
    rollouts_manifest = manifest(rdir)
    if rollouts_manifest is None:
        raise StageError(
            f"{rdir}: rollouts are not complete; run generate (or import) for iteration {iteration}"
        )
    ctl = kl_controller_for(cfg, iteration)
    kl_coef = ctl.value if s.kl_in_reward else 0.0
    sdir = stage_dir(cfg.run_dir, iteration, "scores")
    inputs = {
        "rollouts": {k: rollouts_manifest[k] for k in ("key", "rows")},
        "ref_model": model_fingerprint(cfg.ref, "ref_model"),
        "reward_model": model_fingerprint(cfg.reward_model, "reward_model") if cfg.reward_model else None,
        "kl_controller": ctl.state_dict(),
        "kl_coef": kl_coef,
    }
    stage = StageRun(sdir, "scores", identity(cfg), inputs, force, cfg.to_dict())
    if stage.complete:
        return manifest(sdir) or {}
    n_parts = math.ceil(rollouts_manifest["rows"] / s.rows_per_part)
    todo = stage.todo(n_parts)
    if todo:
        rollouts = read_stage(rdir, ROLLOUTS)
        scorer = Scorer(cfg, pc.unique(rollouts["policy"].drop_null()).to_pylist(), fns, kl_coef)
        scorer.score_parts(stage, rollouts, todo, str(rdir), quiet)
    dist.barrier()
    kl_extra = (
        controller_extra(sdir, n_parts, ctl, kl_coef)
        if kl_used(cfg)
        else {"kl_coef": 0.0, "mean_kl_sum": None, "kl_controller": ctl.state_dict()}
    )
    extra = {**kl_extra, "max_tokens_per_batch": s.max_tokens_per_batch}
    return stage.finish(n_parts, extra) or manifest(sdir) or {}


def kl_controller_for(cfg: Config, iteration: int) -> KLController:
    """The controller whose value is this iteration's beta (see the module docstring)."""
    s = cfg.score
    ctl = make_controller(s.kl_controller, s.kl_coef, s.kl_target, s.kl_horizon)
    if s.kl_controller == "constant" or iteration == 0:
        return ctl
    prev = stage_dir(cfg.run_dir, iteration - 1, "scores")
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
    for p in list_parts(sdir):
        first.setdefault(part_number(p), p)
    sums = [
        pq.read_table(first[n], columns=["kl_sum"])["kl_sum"].to_numpy() for n in range(n_parts) if n in first
    ]
    kl_sums = np.concatenate(sums) if sums else np.zeros(0)  # [rows]
    mean_kl = float(kl_sums.mean()) if kl_sums.size else 0.0
    after = controller_from_state(ctl.state_dict())
    after.update(mean_kl, int(kl_sums.size))
    return {"kl_coef": kl_coef, "mean_kl_sum": mean_kl, "kl_controller": after.state_dict()}


def batched_logprobs(
    model: Any,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    *,
    pad_id: int,
    max_tokens: int,
    progress: Any = None,
) -> list[np.ndarray]:
    """Log-probs [len(response)] float32 of every row's response tokens, in input order.

    Rows that share their prompt (the G samples of a group) run it through the model once
    (forward.shared_prefix_logprobs, for the model families it supports); otherwise token-budget
    batches over length-sorted rows (forward.response_logprobs)."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(lengths)
    uniq: dict[tuple[int, ...], int] = {}
    prompt_of = [uniq.setdefault(tuple(p), len(uniq)) for p in prompt_ids]
    with torch.inference_mode():
        if len(uniq) < len(prompt_ids) and can_share_prefix(model):
            for rows in _prompt_chunks(prompt_of, [len(p) for p in uniq], 8 * max_tokens):
                local: dict[int, int] = {}  # prompt index -> its index among this chunk's prompts
                for r in rows:
                    local.setdefault(prompt_of[r], len(local))
                first = {j: r for r in reversed(rows) for j in [prompt_of[r]]}  # a row of each prompt
                lps = shared_prefix_logprobs(
                    model,
                    [prompt_ids[first[j]] for j in local],
                    [response_ids[i] for i in rows],
                    [local[prompt_of[i]] for i in rows],
                    temperature,
                    pad_id=pad_id,
                    max_tokens=max_tokens,
                )
                for i, lp in zip(rows, lps, strict=True):
                    if len(response_ids[i]):
                        out[i] = lp.cpu().numpy()
                if progress is not None:
                    progress(sum(lengths[i] for i in rows))
            return out
        for batch in token_budget_batches(lengths, max_tokens):
            seqs = [prompt_ids[i] + response_ids[i] for i in batch]
            logp, _, _ = response_logprobs(
                model, seqs, [len(prompt_ids[i]) for i in batch], temperature, pad_id=pad_id
            )  # [b, T]
            logp_np = logp.cpu().numpy()  # [b, T]
            for j, i in enumerate(batch):
                out[i] = logp_np[j, : len(response_ids[i])].copy()  # [T_i]
            if progress is not None:
                progress(sum(lengths[i] for i in batch))
    return out


def _prompt_chunks(prompt_of: list[int], p_lens: list[int], max_prompt_tokens: int) -> list[list[int]]:
    """Rows cut into chunks of whole groups whose distinct prompts hold <= max_prompt_tokens
    tokens (one group at least): the prompts' keys and values of a chunk are kept in memory."""
    groups: dict[int, list[int]] = {}
    for i, j in enumerate(prompt_of):
        groups.setdefault(j, []).append(i)
    chunks: list[list[int]] = []
    held = max_prompt_tokens
    for j, rows in groups.items():
        if held + p_lens[j] > max_prompt_tokens:
            chunks.append([])
            held = 0
        chunks[-1].extend(rows)
        held += p_lens[j]
    return chunks


class Scorer:
    """Models and reward functions of one score run; `score_parts` writes the parts."""

    def __init__(self, cfg: Config, policies: list[str], fns: list[RewardFunction], kl_coef: float):
        self.cfg, self.fns, self.kl_coef = cfg, fns, kl_coef
        self.kl = kl_used(cfg)
        self.device = dist.stage_device(cfg.device)
        self.ref_tok = check_tokenizers(cfg, policies)
        self.vocab_size = config_vocab_size(cfg.ref)
        self._ref_model: Any = None
        self.rm = None
        if cfg.reward_model:
            from rlhf_batch.rewards.model import RewardModel

            self.rm = RewardModel(
                cfg.reward_model, device=self.device, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code
            )
            self.vocab_size = min(self.vocab_size, self.rm.vocab_size)

    @property
    def ref_model(self) -> Any:
        if self._ref_model is None:  # loaded only when some rollout needs a reference forward
            self._ref_model = load_model(
                self.cfg.ref,
                "ref_model",
                device=self.device,
                dtype=self.cfg.dtype,
                trust_remote_code=self.cfg.trust_remote_code,
            )
            fault_point("scores:model-loaded")
        return self._ref_model

    def score_parts(
        self, stage: StageRun, rollouts: pa.Table, todo: list[int], where: str, quiet: bool
    ) -> None:
        rows = self.cfg.score.rows_per_part
        lengths = pc.add(
            pc.list_value_length(rollouts["prompt_ids"]), pc.list_value_length(rollouts["response_ids"])
        )
        total = sum(int(pc.sum(lengths.slice(n * rows, rows)).as_py() or 0) for n in todo)
        total *= 2 if self.rm is not None else 1  # the reward model reads every token once more
        with tqdm(
            total=total, unit="tok", unit_scale=True, desc="score", disable=quiet, dynamic_ncols=True
        ) as bar:
            for n in todo:
                part = rollouts.slice(n * rows, rows)
                table, counts = self.score_part(
                    part, f"{where} (rows {n * rows}..{n * rows + part.num_rows - 1})", bar.update
                )
                stage.write(n, table, table.schema, counts)

    def score_part(self, t: pa.Table, where: str, progress: Any) -> tuple[pa.Table, dict[str, int]]:
        check_rollouts(t, where, self.vocab_size)
        rid, prompt_ids, response_ids = (
            t[c].to_pylist() for c in ("rollout_id", "prompt_ids", "response_ids")
        )
        values = self.rewards(t, rid, prompt_ids, response_ids)
        if self.rm is not None:
            seqs = [p + r for p, r in zip(prompt_ids, response_ids, strict=True)]
            values[RM_COLUMN] = self.rm.scores(seqs, self.cfg.score.max_tokens_per_batch, progress).tolist()
        r_len = np.array([len(r) for r in response_ids], dtype=np.int64)  # [B]
        if not self.kl:
            progress(int(r_len.sum()) + sum(len(p) for p in prompt_ids))  # no reference forward
            return self.finish_part(t, values, r_len, None)
        beh = pc.list_flatten(t["behavior_logprobs"]).to_numpy().astype(np.float32)  # [N]
        ref = self.ref_logprobs(t, prompt_ids, response_ids, beh, r_len, progress)  # [N]
        row = torch.repeat_interleave(torch.arange(len(rid)), torch.from_numpy(r_len))  # [N]
        kl = kl_estimate(
            torch.from_numpy(beh).double(), torch.from_numpy(ref).double(), self.cfg.score.kl_estimator
        )  # [N] float64
        kl_sum = torch.zeros(len(rid), dtype=torch.float64).index_add_(0, row, kl).tolist()  # [B]
        return self.finish_part(t, values, r_len, (ref, kl.float().numpy() + 0.0, kl_sum))

    def finish_part(
        self,
        t: pa.Table,
        values: dict[str, list[float | None]],
        r_len: np.ndarray,
        kl_cols: tuple[np.ndarray, np.ndarray, list[float]] | None,
    ) -> tuple[pa.Table, dict[str, int]]:
        """The part's table from the rewards and (ref_logprobs [N], kl [N], kl_sum [B]) or, when
        no KL is used, None: those columns null and reward = score."""
        rid = t["rollout_id"].to_pylist()
        weights = {rf.column: rf.weight for rf in self.fns}
        if self.rm is not None:
            weights[RM_COLUMN] = self.cfg.score.reward_model_weight
        raw = weighted_sum(values, weights, len(rid))
        score = [clip(x, self.cfg.score.score_clip) for x in raw]
        offsets = pa.array(np.concatenate([[0], np.cumsum(r_len)]).astype(np.int32))  # [B + 1]
        ref, kl = (kl_cols[0], kl_cols[1]) if kl_cols else (None, None)
        kl_sum: list[float | None] = list(kl_cols[2]) if kl_cols else [None] * len(rid)
        cols: dict[str, Any] = {
            "rollout_id": t["rollout_id"].combine_chunks(),
            "prompt_id": t["prompt_id"].combine_chunks(),
            "reward_raw": raw,
            "score": score,
            "ref_logprobs": None
            if ref is None
            else pa.ListArray.from_arrays(offsets, pa.array(ref, pa.float32())),
            "kl": None if kl is None else pa.ListArray.from_arrays(offsets, pa.array(kl, pa.float32())),
            "kl_sum": kl_sum,
            "kl_coef": [self.kl_coef] * len(rid),
            "reward": [
                None if s is None else s if k is None else s - self.kl_coef * k
                for s, k in zip(score, kl_sum, strict=True)
            ],
            **values,
        }
        schema = with_extra(SCORES, pa.schema([(c, pa.float64()) for c in values]))
        table = pa.Table.from_arrays(
            [
                pa.nulls(len(rid), f.type) if cols[f.name] is None else pa.array(cols[f.name], f.type)
                for f in schema
            ],
            schema=schema,
        )
        counts = {"rows": len(rid), "tokens": int(r_len.sum()), "unscored": sum(s is None for s in score)}
        counts.update({f"unscored_{c}": sum(v is None for v in vals) for c, vals in values.items()})
        return table, counts

    def rewards(
        self, t: pa.Table, rid: list[str], prompt_ids: list[list[int]], response_ids: list[list[int]]
    ) -> dict[str, list[float | None]]:
        columns = {c: t[c].to_pylist() for c in t.column_names if c not in ROLLOUTS.names}
        prompts, responses = t["prompt"].to_pylist(), t["response"].to_pylist()
        return {
            rf.column: call_reward_function(
                rf,
                rid,
                prompts=prompts,
                responses=responses,
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                columns=columns,
            )
            for rf in self.fns
        }

    def ref_logprobs(
        self,
        t: pa.Table,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        beh: np.ndarray,
        r_len: np.ndarray,
        progress: Any,
    ) -> np.ndarray:
        """[N] reference log-probs: copies of the behaviour ones where the rollout's policy is the
        reference model itself, one forward pass of the reference for the other rows."""
        offsets = np.concatenate([[0], np.cumsum(r_len)])  # [B + 1]
        ref = beh.copy()  # [N]
        policies = t["policy"].to_pylist()
        is_ref = {p: same_dir(p, self.cfg.ref) for p in set(policies)}
        need = [i for i, p in enumerate(policies) if r_len[i] and not is_ref[p]]
        skip = set(range(len(prompt_ids))) - set(need)
        progress(sum(len(prompt_ids[i]) + int(r_len[i]) for i in skip))
        if need:
            lps = batched_logprobs(
                self.ref_model,
                [prompt_ids[i] for i in need],
                [response_ids[i] for i in need],
                self.cfg.generate.temperature,
                pad_id=int(self.ref_tok.pad_token_id),
                max_tokens=self.cfg.score.max_tokens_per_batch,
                progress=progress,
            )
            for i, lp in zip(need, lps, strict=True):
                ref[offsets[i] : offsets[i + 1]] = lp
        return ref
