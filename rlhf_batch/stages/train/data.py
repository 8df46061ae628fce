"""The train stage's data: the advantages parts as flat arrays, the step plan, micro-batches.

The plan is a pure function of the advantages rows, the config and the seed, so a resumed run
replays exactly the same steps and the data position in a checkpoint is just a step index:

* Epoch 0 keeps the row order the advantage stage wrote (length-bucketed, seeded). The rows
  are cut into contiguous optimizer steps of about `tokens_per_step` response tokens (there
  are ceil(total / tokens_per_step) steps and the cuts balance their tokens), or, with
  `sequences_per_step` > 0, of about that many rows (ceil(rows / sequences_per_step) steps,
  as TRL's per-device batch or verl's mini-batch counts rollouts), and each step
  into micro-batches by `core.batching.token_budget_batches` over the full sequence lengths
  (padded rows x longest row <= `max_tokens_per_batch`; with `max_padding` < 1 a micro-batch
  is also closed before its padding exceeds that share of its tokens: train.max_padding).
* Epoch e >= 1 reuses those micro-batches in an order shuffled by a generator seeded with
  (seed, iteration, e), cut again into steps of about `tokens_per_step` tokens (or rows).
* Advantages: the row's `advantage` on every token, or with `token_advantages` in the parts
  (advantage.estimator = "opd") each token's own ([B, T] in the micro-batch).
* Rows that cannot move the loss (advantage 0, or every token advantage 0, while no KL or
  entropy term is on: their gradient is exactly zero) keep their place in the plan (the plan of all rows, every epoch),
  in their step's counts and hence in its normaliser, but are taken out of its micro-batches
  (`active`): a step of such rows alone runs no forward pass and still takes its optimizer
  step (on zero gradients), as it would had they been computed. Diagnostics (clip fraction,
  KL, entropy, ESS, tokens/s) cover the rows run; a step that runs none records them null.
* Objectives (train.objective, data/selection.py): an SFT iteration's rows are planned as
  above, all of them active; a DPO iteration's parts hold preference pairs (columns `pair`,
  `chosen`), which are planned as units (`plan_steps`' `pairs`): a pair's two rows, chosen then
  rejected, are always in one micro-batch, its sampled tokens counting towards the budget of its
  step and its longer row, twice, towards the token budget of its micro-batch.
* Ranks: micro-batch j of a step goes to rank j % world. A rank with fewer micro-batches than
  the others runs the step's shortest row with weight 0, so that every rank does the same
  number of forward/backward passes (DDP needs it). The global batch of a step, and hence its
  loss normaliser, never depends on the number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlhf_batch.core.batching import token_budget_batches
from rlhf_batch.core.masking import padded_rows, sampled_lengths
from rlhf_batch.errors import StageError
from rlhf_batch.stages.loss_mask import flat_mask
from rlhf_batch.store import manifests
from rlhf_batch.store.manifests import read_complete as read_stage
from rlhf_batch.store.schemas import ADVANTAGES

COLUMNS = ["rollout_id", "input_ids", "prompt_len", "behavior_logprobs", "ref_logprobs", "advantage"]


@dataclass
class TrainRows:
    """The advantages table, flat: row i's tokens are ids[ids_off[i]:ids_off[i + 1]]."""

    rollout_ids: list[str]
    ids: np.ndarray  # [sum L] int64, prompt + response tokens
    ids_off: np.ndarray  # [N + 1]
    prompt_lens: np.ndarray  # [N] int64
    old: np.ndarray  # [sum T] float32, behaviour log-probs (or recomputed ones)
    ref: np.ndarray | None  # [sum T] float32, reference log-probs; None: all null (no KL used)
    resp_off: np.ndarray  # [N + 1]
    adv: np.ndarray  # [N] float32
    behavior: np.ndarray | None = None  # [sum T] the engine's log-probs, kept when `old` is recomputed
    tok_adv: np.ndarray | None = None  # [sum T] float32, per-token advantages (opd); None: `adv` per row
    loss_mask: np.ndarray | None = None  # [sum T] bool, sampled by the policy (multi-turn); None: all
    objective: str = "grpo"  # what the rows are for (train.objective): grpo, sft, dpo
    pairs: np.ndarray | None = None  # [P, 2] int64, dpo: the rows of each pair, chosen then rejected

    @property
    def trained_lens(self) -> np.ndarray:
        """[N] the tokens each row trains on: the sampled ones (core/masking.py)."""
        return sampled_lengths(self.loss_mask, self.resp_off, self.resp_lens)

    def check_vocabulary(self, vocab_size: int, where: str) -> None:
        """StageError naming the rollout whose input_ids hold a token outside [0, vocab_size)."""
        bad = np.flatnonzero((self.ids < 0) | (self.ids >= vocab_size))
        if bad.size:
            row = int(np.searchsorted(self.ids_off, bad[0], side="right")) - 1
            raise StageError(
                f"{where}: rollout {self.rollout_ids[row]}: column 'input_ids' holds token id "
                f"{self.ids[bad[0]]}, outside the policy's vocabulary [0, {vocab_size})"
            )

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def seq_lens(self) -> np.ndarray:
        return np.diff(self.ids_off)  # [N]

    @property
    def resp_lens(self) -> np.ndarray:
        return np.diff(self.resp_off)  # [N]


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _flat(arr: pa.ListArray, dtype: Any) -> np.ndarray:
    return np.asarray(arr.flatten().to_numpy(zero_copy_only=False), dtype=dtype)


def load_rows(sdir: Path, need_ref: bool = False, objective: str = "grpo") -> TrainRows:
    """Read and check a complete advantages stage; errors name the directory, rollout and column.
    `ref_logprobs` may be null in every row (score used no KL) unless `need_ref` or the
    `objective` is dpo (its loss reads them); dpo's parts hold pairs (`pair`, `chosen`)."""
    per_token = _has_token_advantages(sdir)  # advantage.estimator = "opd"
    masked = _has_column(sdir, "loss_mask")  # multi-turn rollouts
    dpo = objective == "dpo"
    columns = COLUMNS + ["token_advantages"] * per_token + ["loss_mask"] * masked + ["pair", "chosen"] * dpo
    table = read_stage(sdir, ADVANTAGES, columns=columns).combine_chunks()
    if table.num_rows == 0:
        raise StageError(
            f"{sdir}: the advantages table has 0 rows (every group filtered out?); nothing to train on"
        )
    rids = table.column("rollout_id").to_pylist()
    no_ref = table.column("ref_logprobs").null_count == table.num_rows  # score used no KL
    if no_ref and dpo:
        raise StageError(
            f"{sdir}: train.objective 'dpo' needs the reference log-probs (ref_logprobs), but they are null; "
            "score the iteration again (score computes them when train.objective has 'dpo')"
        )
    if no_ref and need_ref:
        raise StageError(
            f"{sdir}: train.kl_loss_coef > 0 needs ref_logprobs, but they are null (scored without KL); "
            "score the iteration again with train.kl_loss_coef set"
        )
    for name in [
        c for c in table.column_names[1:] if not (no_ref and c == "ref_logprobs") and c != "loss_mask"
    ]:
        col = table.column(name)
        if col.null_count:
            row = pc.index(pc.is_null(col), True).as_py()
            raise StageError(f"{sdir}: rollout {rids[row]}: column '{name}' is null")
    seq = pc.list_value_length(table.column("input_ids")).to_numpy().astype(np.int64)  # [N]
    plen = table.column("prompt_len").to_numpy().astype(np.int64)  # [N]
    resp = seq - plen  # [N]
    _check(sdir, rids, (plen < 1) | (resp < 0), "prompt_len", "must be in [1, len(input_ids)]")
    lists = ("behavior_logprobs",) + ("ref_logprobs",) * (not no_ref) + ("token_advantages",) * per_token
    for name in lists:
        n = pc.list_value_length(table.column(name)).to_numpy().astype(np.int64)  # [N]
        _check(sdir, rids, n != resp, name, "must have one value per response token")
    adv = table.column("advantage").to_numpy().astype(np.float32)  # [N]
    _check(sdir, rids, ~np.isfinite(adv), "advantage", "must be finite")
    if resp.sum() == 0:
        raise StageError(f"{sdir}: no row has a response token; nothing to train on")
    chunk = {name: table.column(name).chunk(0) for name in table.column_names[1:]}
    old = _flat(chunk["behavior_logprobs"], np.float32)
    ref = None if no_ref else _flat(chunk["ref_logprobs"], np.float32)
    tok_adv = _flat(chunk["token_advantages"], np.float32) if per_token else None
    resp_off = _offsets(resp)
    for name, flat in (("behavior_logprobs", old), ("ref_logprobs", ref), ("token_advantages", tok_adv)):
        if flat is None:
            continue
        bad = np.flatnonzero(~np.isfinite(flat))  # token positions; a NaN would poison the loss
        if bad.size:
            row = int(np.searchsorted(resp_off, bad[0], side="right")) - 1
            raise StageError(f"{sdir}: rollout {rids[row]}: column '{name}' has a NaN or inf log-prob")
    return TrainRows(
        rollout_ids=rids,
        ids=_flat(chunk["input_ids"], np.int64),
        ids_off=_offsets(seq),
        prompt_lens=plen,
        old=old,
        ref=ref,
        resp_off=resp_off,
        adv=adv,
        tok_adv=tok_adv,
        loss_mask=flat_mask(table, resp) if masked else None,
        objective=objective,
        pairs=_pairs(sdir, table) if dpo else None,
    )


def _pairs(sdir: Path, table: pa.Table) -> np.ndarray:
    """[P, 2] the rows of each pair, chosen then rejected (pairs in their order); pairs that are
    not one chosen and one rejected row each are a StageError naming the columns."""
    pair = table.column("pair").to_numpy().astype(np.int64)  # [N]
    chosen = table.column("chosen").to_numpy(zero_copy_only=False).astype(bool)  # [N]
    order = np.lexsort((~chosen, pair))  # [N] by pair, its chosen row first
    p, c = pair[order], chosen[order]  # [N] each
    if len(order) % 2 or (p[0::2] != p[1::2]).any() or not c[0::2].all() or c[1::2].any():
        raise StageError(
            f"{sdir}: columns 'pair' and 'chosen' do not give each pair one chosen and one rejected row; "
            "redo advantage"
        )
    return order.reshape(-1, 2)  # [P, 2]


def _has_column(sdir: Path, name: str) -> bool:
    """Whether a part carries column `name`, from the footers: every part, since replayed rows
    (advantage.replay) of a multi-turn iteration bring their `loss_mask` into the parts after a
    single-turn iteration's own (the rows of a part without it read as null: all ones)."""
    parts = (manifests.manifest(sdir) or {}).get("parts", [])
    return any(
        manifests.parquet_file(sdir / p["file"]).schema_arrow.get_field_index(name) >= 0 for p in parts
    )


def _has_token_advantages(sdir: Path) -> bool:
    """Whether the parts carry `token_advantages` (advantage.estimator = "opd"), from the first
    part's footer; every part of a folder is written by one config."""
    parts = (manifests.manifest(sdir) or {}).get("parts", [])
    if not parts:
        return False
    return (
        manifests.parquet_file(sdir / parts[0]["file"]).schema_arrow.get_field_index("token_advantages") >= 0
    )


def _check(sdir: Path, rids: list[str], bad: np.ndarray, column: str, what: str) -> None:
    if bad.any():
        row = int(np.argmax(bad))
        raise StageError(f"{sdir}: rollout {rids[row]}: column '{column}' {what}")


@dataclass(frozen=True)
class Step:
    """One optimizer step: its micro-batches over all ranks (row indices) and global counts."""

    index: int  # over all epochs
    epoch: int
    micro: tuple[tuple[int, ...], ...]
    tokens: int  # response tokens of the step (all ranks): the token_mean normaliser
    sequences: int  # rows with at least one response token: the seq_mean_* normaliser
    filler: int  # the step's shortest row, run with weight 0 by a rank short of micro-batches

    def for_rank(self, rank: int, world: int) -> list[tuple[tuple[int, ...], float]]:
        """(rows, weight) of the micro-batches `rank` runs; every rank gets the same count."""
        mine = [(mb, 1.0) for mb in self.micro[rank::world]]
        count = -(-len(self.micro) // world)
        return mine + [((self.filler,), 0.0)] * (count - len(mine))


def cut_balanced(tokens: Sequence[int], budget: int) -> list[list[int]]:
    """Contiguous groups of indices with balanced token sums, at most ceil(sum / budget) of them.

    Cutting [0, total) into n equal spans, item i joins the span holding its middle token.
    """
    total = int(sum(tokens))
    if total == 0:
        return [list(range(len(tokens)))] if len(tokens) else []
    n = max(1, math.ceil(total / budget))
    groups: list[list[int]] = [[] for _ in range(n)]
    before = 0
    for i, t in enumerate(tokens):
        groups[min(n - 1, (2 * before + int(t)) * n // (2 * total))].append(i)
        before += int(t)
    return [g for g in groups if g]


def _step(
    index: int, epoch: int, micro: list[tuple[int, ...]], resp_lens: np.ndarray, active: np.ndarray | None
) -> Step:
    """Counts over every row of the step; its micro-batches keep their active rows only (the plan
    is the one of all rows, `active` or not, so later epochs reshuffle the same micro-batches)."""
    rows = [i for mb in micro for i in mb]
    lens = resp_lens[rows]  # [n]
    filler = rows[int(np.argmin(lens))]
    if active is not None:
        micro = [kept for kept in (tuple(i for i in mb if active[i]) for mb in micro) if kept]
    return Step(index, epoch, tuple(micro), int(lens.sum()), int((lens > 0).sum()), filler)


def plan_steps(
    resp_lens: np.ndarray,
    seq_lens: np.ndarray,
    tokens_per_step: int,
    max_tokens_per_batch: int,
    epochs: int,
    seed: tuple[int, ...],
    max_padding: float = 1.0,
    sequences_per_step: int = 0,
    active: np.ndarray | None = None,
    pairs: np.ndarray | None = None,
) -> list[Step]:
    """Every optimizer step of the stage, in order (see the module docstring). `active` [N]
    bool: the rows to compute (None: all). `pairs` [P, 2] (dpo): the plan of the pairs as units,
    each micro-batch then expanded to its pairs' rows, chosen 0, rejected 0, chosen 1, ..."""
    if pairs is not None:
        units_plan = plan_steps(
            resp_lens[pairs].sum(1),  # [P]
            seq_lens[pairs].max(1),  # [P]
            tokens_per_step,
            max(1, max_tokens_per_batch // 2),  # two rows of the longer one's length each
            epochs,
            seed,
            max_padding,
            max(1, sequences_per_step // 2) if sequences_per_step else 0,
        )
        expanded = [[tuple(int(i) for p in mb for i in pairs[p]) for mb in u.micro] for u in units_plan]
        return [
            _step(u.index, u.epoch, micro, resp_lens, None)
            for u, micro in zip(units_plan, expanded, strict=True)
        ]
    # what a step's budget counts: response tokens, or rows (sequences_per_step > 0)
    units = np.ones_like(resp_lens) if sequences_per_step else resp_lens  # [N]
    budget = sequences_per_step or tokens_per_step
    first: list[list[tuple[int, ...]]] = []
    for rows in cut_balanced(units.tolist(), budget):
        batches = token_budget_batches([int(seq_lens[i]) for i in rows], max_tokens_per_batch, max_padding)
        first.append([tuple(rows[k] for k in b) for b in batches])
    steps = [_step(i, 0, micro, resp_lens, active) for i, micro in enumerate(first)]
    micro_all = [mb for micro in first for mb in micro]
    for epoch in range(1, epochs):
        rng = np.random.default_rng([*seed, epoch])
        order = [micro_all[j] for j in rng.permutation(len(micro_all))]
        per_mb = [int(units[list(mb)].sum()) for mb in order]
        for group in cut_balanced(per_mb, budget):
            steps.append(_step(len(steps), epoch, [order[j] for j in group], resp_lens, active))
    return steps


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based) of `total`.

    Linear warmup (step + 1) / warmup over the first `warmup` steps, then constant, or a
    cosine / linear decay from 1 towards 0 over the remaining steps. The schedule is a pure
    function of the step, so the step index in a checkpoint is the whole scheduler state.
    `step` counts the run's optimizer steps (over iterations); past `total` the decay stays at
    its end value (0).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0


def micro_batch(s: TrainRows, rows: Sequence[int], device: Any) -> Any:
    """Rows -> TensorDict of right-padded input_ids [B, L], old/ref log-probs [B, T], ... and the
    LM head's positions (`forward.response_positions`: `select`, `place` [N]), all made on the
    host from the lengths it knows, then copied to `device` in one go: on CUDA from pinned memory
    without waiting (nothing in a micro-batch reads a device value back to the host)."""
    import torch
    from tensordict import TensorDict

    from rlhf_batch.models.forward import response_positions

    rows = list(rows)
    seq, resp = s.seq_lens[rows], s.resp_lens[rows]  # [B], [B]
    b, width, t = len(rows), int(seq.max()), int(resp.max())
    ids = np.zeros((b, width), np.int64)  # [B, L]
    old, ref = np.zeros((b, t), np.float32), np.zeros((b, t), np.float32)  # [B, T]
    for k, i in enumerate(rows):
        ids[k, : seq[k]] = s.ids[s.ids_off[i] : s.ids_off[i + 1]]
        old[k, : resp[k]] = s.old[s.resp_off[i] : s.resp_off[i + 1]]
        if s.ref is not None:
            ref[k, : resp[k]] = s.ref[s.resp_off[i] : s.resp_off[i + 1]]
    select, place, mask = response_positions(seq, s.prompt_lens[rows])  # [N], [N], [B, T]
    if s.loss_mask is not None:  # multi-turn: the environment's tokens are context, not trained
        mask = mask & padded_rows(s.loss_mask, s.resp_off, rows, mask.shape[1])  # [B, T]
    extra = {}
    if s.behavior is not None:  # truncated importance sampling: the engine's log-probs too
        beh = np.zeros((b, t), np.float32)  # [B, T]
        for k, i in enumerate(rows):
            beh[k, : resp[k]] = s.behavior[s.resp_off[i] : s.resp_off[i + 1]]
        extra["behavior_logprobs"] = beh
    adv: np.ndarray = s.adv[rows]  # [B], broadcast over the tokens
    if s.tok_adv is not None:  # opd: one advantage per response token
        adv = np.zeros((b, t), np.float32)  # [B, T]
        for k, i in enumerate(rows):
            adv[k, : resp[k]] = s.tok_adv[s.resp_off[i] : s.resp_off[i + 1]]
    data = {
        **extra,
        "input_ids": ids,
        "seq_lens": seq,
        "prompt_lens": s.prompt_lens[rows],
        "old_logprobs": old,
        **({} if s.ref is None else {"ref_logprobs": ref}),
        "advantages": adv,
        "mask": mask,
        "select": select,
        "place": place,
    }
    return TensorDict(
        _to_device({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in data.items()}, device)
    )


def _to_device(tensors: dict[str, Any], device: Any) -> dict[str, Any]:
    """Host tensors -> the same on `device`; to CUDA through pinned memory, asynchronously (the
    copies are ordered on the stream before any kernel that reads them)."""
    import torch

    if torch.device(device).type != "cuda":
        return {k: v.to(device) for k, v in tensors.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}
