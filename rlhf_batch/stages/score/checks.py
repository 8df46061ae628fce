"""Input checks of the score stage: the rollouts table against the contract and the model
vocabulary, and the tokenizers of the policy, reference and reward model against each other.
Every failure is a one-line error naming the rollout or the model directory."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlhf_batch.config import Config
from rlhf_batch.errors import ModelError, SchemaError
from rlhf_batch.models.load import load_tokenizer, vocab_signature
from rlhf_batch.store.fs import run_path
from rlhf_batch.store.modeldir import check_model_dir, same_dir
from rlhf_batch.store.schemas import ROLLOUTS


def origin(path: str) -> str:
    """The model a policy directory holds the weights of: following the records of policies
    carried forward unchanged (train/empty.py) back to the first, while each source still has the
    fingerprint recorded when it was copied."""
    from rlhf_batch.store.modeldir import carried_from, model_fingerprint, without_path

    p = run_path(path)  # a policy on the object store too
    while (carried := carried_from(p)) is not None:
        src, fingerprint = carried
        try:
            if without_path(model_fingerprint(src, "policy")) != fingerprint:
                break
        except ModelError:
            break
        p = run_path(src)
    return str(p)


def same_model(policy: str | None, ref: str | None) -> bool:
    """The policy's weights are the reference's: the same directory, or carried forward from it."""
    return bool(policy) and bool(ref) and same_dir(origin(str(policy)), ref)


def check_rollouts(t: pa.Table, where: str, vocab_size: int) -> None:
    """SchemaError naming the rollout: nulls, empty prompts, log-prob/response length mismatch,
    non-finite behaviour log-probs, token ids outside the vocabulary."""
    rid = t["rollout_id"].to_pylist()
    for name in ROLLOUTS.names:
        if t[name].null_count:
            i = int(np.flatnonzero(t[name].is_null().to_numpy(zero_copy_only=False))[0])
            raise SchemaError(f"{where}: column '{name}' is null in rollout {rid[i]}")
    p_len = pc.list_value_length(t["prompt_ids"]).to_numpy()  # [B]
    r_len = pc.list_value_length(t["response_ids"]).to_numpy()  # [B]
    b_len = pc.list_value_length(t["behavior_logprobs"]).to_numpy()  # [B]
    for bad, what in (
        (p_len == 0, "has no prompt tokens"),
        (r_len != b_len, "has behavior_logprobs of another length than its response_ids"),
    ):
        if bad.any():
            raise SchemaError(f"{where}: rollout {rid[int(np.flatnonzero(bad)[0])]} {what}")
    beh = pc.list_flatten(t["behavior_logprobs"]).to_numpy()  # [N]
    if not np.isfinite(beh).all():
        row = np.searchsorted(np.cumsum(r_len), np.flatnonzero(~np.isfinite(beh))[0], side="right")
        raise SchemaError(f"{where}: rollout {rid[int(row)]} has a NaN or inf behavior log-prob")
    for name, lens in (("prompt_ids", p_len), ("response_ids", r_len)):
        ids = pc.list_flatten(t[name]).to_numpy()  # [N]
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            row = int(np.searchsorted(np.cumsum(lens), bad[0], side="right"))
            raise SchemaError(
                f"{where}: rollout {rid[row]} has token id {ids[bad[0]]} in {name}, "
                f"outside the model vocabulary [0, {vocab_size})"
            )


def _tokenizer(path: str, what: str, cfg: Config) -> Any:
    if not path:
        raise ModelError(f"{what}: no model directory configured")
    try:
        return load_tokenizer(path, cfg.trust_remote_code)
    except ModelError as e:
        raise ModelError(f"{what}: {e}") from None


def check_tokenizers(cfg: Config, policies: list[str]) -> Any:
    """The reference tokenizer, after checking that those of the policies named in the rollouts
    (the ones that are model directories) have the same vocabulary. (A reward model with another
    vocabulary re-tokenises the text: see rlhf_batch.rewards.model.)"""
    ref_tok = _tokenizer(cfg.ref, "ref_model", cfg)
    others = [(p, "policy") for p in policies if (run_path(p) / "config.json").is_file()]
    for path, what in others:
        if not same_dir(path, cfg.ref) and vocab_signature(_tokenizer(path, what, cfg)) != vocab_signature(
            ref_tok
        ):
            raise ModelError(
                f"the tokenizers of the {what} ({path}) and of the reference model ({cfg.ref}) "
                "have different vocabularies; their token ids and log-probs cannot be compared"
            )
    return ref_tok


def config_vocab_size(path: str) -> int:
    raw = json.loads((check_model_dir(path, "ref_model") / "config.json").read_text())
    size = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise ModelError(f"ref_model: {path}/config.json has no vocab_size")
    return size


def check_teacher(cfg: Config, ref_tok: Any) -> int:
    """score.teacher_model: its tokenizer has the vocabulary of the policy's (the reference's,
    which check_tokenizers compared with the policies'); returns its vocab_size."""
    teacher = cfg.score.teacher_model
    tok = _tokenizer(teacher, "score.teacher_model", cfg)
    if vocab_signature(tok) != vocab_signature(ref_tok):
        raise ModelError(
            f"score.teacher_model: the tokenizer of {teacher} differs from the policy's ({cfg.ref}); "
            "on-policy distillation needs the teacher's log-probs of the policy's own token ids"
        )
    raw = json.loads((check_model_dir(teacher, "score.teacher_model") / "config.json").read_text())
    size = raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise ModelError(f"score.teacher_model: {teacher}/config.json has no vocab_size")
    return size
