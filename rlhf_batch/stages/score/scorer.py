"""One part of rollouts scored (`Scorer.score_part`): the reward functions' values, the reward
model's scores, the teacher's and the reference's log-probs, per-token KL and the shaped reward.
The columns are described in stage.py."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlhf_batch.config import Config
from rlhf_batch.core.kl import kl_estimate, kl_shaped_reward, sequence_kl
from rlhf_batch.core.masking import zero_unsampled
from rlhf_batch.models.forward import batched_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.rewards import (
    RM_COLUMN,
    RewardFunction,
    clip,
    weighted_sum,
)
from rlhf_batch.rewards.cache import RewardCalls
from rlhf_batch.runtime import dist
from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.stages.loss_mask import flat_mask
from rlhf_batch.stages.score.checks import (
    check_rollouts,
    check_teacher,
    check_tokenizers,
    config_vocab_size,
    same_model,
)
from rlhf_batch.store import layout
from rlhf_batch.store.schemas import SCORES, with_extra


def kl_used(cfg: Config) -> bool:
    """KL to the reference enters the reward or the loss, or DPO's loss reads the reference
    log-probs (train.objective "dpo"), so score computes them."""
    s = cfg.score
    return (
        (s.kl_in_reward and s.kl_reward_coef > 0) or cfg.train.kl_loss_coef > 0 or cfg.uses_objective("dpo")
    )


class Scorer:
    """Models and reward functions of one score run; `score_parts` writes the parts."""

    def __init__(self, cfg: Config, policies: list[str], fns: list[RewardFunction], kl_coef: float):
        self.cfg, self.fns, self.kl_coef = cfg, fns, kl_coef
        self.calls = RewardCalls.from_config(cfg)  # rewards/cache.py: the cache, async calls
        self.kl = kl_used(cfg)
        self.device = dist.stage_device(cfg.device)
        self.ref_tok = check_tokenizers(cfg, policies)
        self.vocab_size = config_vocab_size(cfg.ref)
        self._ref_model: Any = None
        self.teacher: Any = None  # score.teacher_model, loaded when set
        if cfg.score.teacher_model:
            self.vocab_size = min(self.vocab_size, check_teacher(cfg, self.ref_tok))
            self.teacher = load_model(
                cfg.score.teacher_model,
                "score.teacher_model",
                device=self.device,
                dtype=cfg.dtype,
                trust_remote_code=cfg.trust_remote_code,
            )
        self.judge: Any = None  # score.judge_model (stages/score/judge.py), loaded when set
        if cfg.score.judge_model:
            from rlhf_batch.stages.score.judge import Judge

            self.judge = Judge(cfg, self.device, self.calls.cache)
        self.rm = None
        if cfg.reward_model:
            from rlhf_batch.rewards.model import RewardModel

            self.rm = RewardModel(
                cfg.reward_model,
                device=self.device,
                dtype=cfg.dtype,
                trust_remote_code=cfg.trust_remote_code,
                policy_tokenizer=self.ref_tok,
            )
            if self.rm.same_vocab:  # else it re-tokenises the text: its vocabulary bounds no rollout id
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

    def score_part(self, t: pa.Table, where: str, progress: Any) -> tuple[pa.Table, dict[str, int]]:
        check_rollouts(t, where, self.vocab_size)
        rid, prompt_ids, response_ids = (
            t[c].to_pylist() for c in ("rollout_id", "prompt_ids", "response_ids")
        )
        values, extra = self.rewards(t, rid, prompt_ids, response_ids)
        if self.teacher is not None:
            extra = {**extra, "teacher_logprobs": self.teacher_logprobs(prompt_ids, response_ids, progress)}
        if self.rm is not None:
            seqs = self.rm.sequences(t, prompt_ids, response_ids)
            values[RM_COLUMN] = self.rm.scores(seqs, self.cfg.score.max_tokens_per_batch, progress).tolist()
        judged: dict[str, int] = {}
        if self.judge is not None:
            from rlhf_batch.stages.score.judge import SCORE, UNPARSED, VERDICT

            batch = self.calls.batch(t, prompt_ids, response_ids)
            values[SCORE], verdicts, judged[UNPARSED] = self.judge.score(batch, t["prompt_id"].to_pylist())
            extra = {**extra, VERDICT: pa.array(verdicts, pa.string())}
        weights = reward_parts(self.cfg, self.fns)
        raw = weighted_sum(values, weights, len(rid))
        score = [clip(x, self.cfg.score.score_clip) for x in raw]
        r_len = np.array([len(r) for r in response_ids], dtype=np.int64)  # [B]
        offsets = pa.array(np.concatenate([[0], np.cumsum(r_len)]).astype(np.int32))  # [B + 1]
        n = len(rid)
        reward: list[float | None] = score  # no KL used
        if self.kl:
            beh = pc.list_flatten(t["behavior_logprobs"]).to_numpy().astype(np.float32)  # [N]
            ref = self.ref_logprobs(t, prompt_ids, response_ids, beh, r_len, progress)  # [N]
            kl = kl_estimate(
                torch.from_numpy(beh).double(), torch.from_numpy(ref).double(), self.cfg.score.kl_estimator
            )  # [N] float64
            kl = zero_unsampled(kl, flat_mask(t, r_len))  # multi-turn: KL on sampled tokens only
            kl_sum = _sequence_sums(kl, r_len)  # [B] float64
            kl_cols: dict[str, Any] = {
                "ref_logprobs": pa.ListArray.from_arrays(offsets, pa.array(ref, pa.float32())),
                "kl": pa.ListArray.from_arrays(offsets, pa.array(kl.float().numpy() + 0.0, pa.float32())),
                "kl_sum": kl_sum.tolist(),
            }
            reward = _shaped(score, kl_sum, self.kl_coef)
        else:  # no KL used: no reference forward, those columns null
            progress(int(r_len.sum()) + sum(len(p) for p in prompt_ids))
            kl_cols = {c: pa.nulls(n, SCORES.field(c).type) for c in ("ref_logprobs", "kl", "kl_sum")}
        cols: dict[str, Any] = {
            "rollout_id": t["rollout_id"].combine_chunks(),
            "prompt_id": t["prompt_id"].combine_chunks(),
            "reward_raw": raw,
            "score": score,
            **kl_cols,
            "kl_coef": [self.kl_coef] * n,
            "reward": reward,
            **values,
            **extra,
        }
        typed = [(c, pa.float64()) for c in values] + [(c, a.type) for c, a in extra.items()]
        schema = with_extra(SCORES, pa.schema(typed))
        table = pa.Table.from_arrays([pa.array(cols[f.name], f.type) for f in schema], schema=schema)
        counts = {"rows": n, "tokens": int(r_len.sum()), "unscored": sum(s is None for s in score), **judged}
        counts.update({f"unscored_{c}": sum(v is None for v in vals) for c, vals in values.items()})
        return table, counts

    def teacher_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], progress: Any
    ) -> pa.Array:
        """list<float32> [B]: the teacher's log-probs of every sampled token (the definition of
        models/forward.py at generate.temperature, as the reference's), one forward pass."""
        lps = batched_logprobs(
            self.teacher,
            prompt_ids,
            response_ids,
            self.cfg.generate.temperature,
            pad_id=int(self.ref_tok.pad_token_id),
            max_tokens=self.cfg.score.max_tokens_per_batch,
            progress=progress,
        )
        return pa.array([lp.tolist() for lp in lps], pa.list_(pa.float32()))

    def rewards(
        self, t: pa.Table, rid: list[str], prompt_ids: list[list[int]], response_ids: list[list[int]]
    ) -> tuple[dict[str, list[float | None]], dict[str, pa.Array]]:
        return reward_values(self.fns, t, rid, prompt_ids, response_ids, calls=self.calls)

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
        is_ref = {p: same_model(layout.from_run(p, self.cfg.run_dir), self.cfg.ref) for p in set(policies)}
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


def reward_values(
    fns: list[RewardFunction],
    t: pa.Table,
    rid: list[str],
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    timeout: float = 0.0,
    calls: RewardCalls | None = None,
) -> tuple[dict[str, list[float | None]], dict[str, pa.Array]]:
    """Each reward function's values for the rollouts rows `t` (column reward_<name> -> one value
    per row) and the extra columns some give, each called by its convention (rewards.conventions)
    with the rows' prompts, responses, token ids and carried columns; each call may take at most
    `timeout` seconds (score.reward_timeout; 0: no limit). `calls`: the cache and async settings
    (rewards.cache.RewardCalls; default: no cache, `timeout`)."""
    calls = calls or RewardCalls(timeout)
    return calls.values(fns, rid, calls.batch(t, prompt_ids, response_ids))


def reward_parts(cfg: Config, fns: list[RewardFunction]) -> dict[str, float]:
    """The scores columns summed into reward_raw and their weights: each reward function's, the
    reward model's (rm_score) and the judge's (judge_score)."""
    from rlhf_batch.stages.score.judge import SCORE

    weights = {rf.column: rf.weight for rf in fns}
    if cfg.reward_model:
        weights[RM_COLUMN] = cfg.score.reward_model_weight
    if cfg.score.judge_model:
        weights[SCORE] = cfg.score.judge_weight
    return weights


def _sequence_sums(kl: torch.Tensor, r_len: np.ndarray) -> torch.Tensor:
    """Per-row sums [B] of flat per-token values [N] (row i holds r_len[i] tokens): core.kl.sequence_kl
    over the [B, T] right-padded layout."""
    lens = torch.from_numpy(r_len)  # [B]
    mask = torch.arange(int(lens.max()) if len(lens) else 0)[None, :] < lens[:, None]  # [B, T]
    padded = kl.new_zeros(mask.shape)  # [B, T]
    padded[mask] = kl
    return sequence_kl(padded, mask)  # [B]


def _shaped(score: list[float | None], kl_sum: torch.Tensor, beta: float) -> list[float | None]:
    """reward = score - beta * kl_sum (core.kl.kl_shaped_reward); null where the score is null."""
    s = torch.tensor([math.nan if x is None else x for x in score], dtype=torch.float64)  # [B]
    reward = kl_shaped_reward(s, kl_sum, beta).tolist()  # [B]
    return [None if x is None else r for x, r in zip(score, reward, strict=True)]
