"""The on-disk contract: pyarrow schemas of every stage's tables, and their validation.

Token ids are list<int32>, log-probs list<float32>, one row per rollout. Each table has
required columns with exact types; extra columns are allowed (rollouts carry the prompt
dataset's other columns along, scores carry one column per reward function) and are passed
through untouched. A missing required column or a column of the wrong type is an error that
names the file and the column.
"""

from __future__ import annotations

import pyarrow as pa

from rlhf_batch.errors import SchemaError

SCHEMA_VERSION = 1
VERSION_KEY = b"rlhf_batch.schema_version"  # in every part's Parquet metadata

TOKENS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())

ROLLOUTS = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("prompt", pa.string()),
        ("prompt_ids", TOKENS),
        ("response", pa.string()),
        ("response_ids", TOKENS),
        ("behavior_logprobs", LOGPROBS),
        ("finish_reason", pa.string()),  # 'stop' | 'length'
        ("policy", pa.string()),  # the checkpoint that generated the rollout
    ]
)

SCORES = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("prompt_id", pa.string()),
        ("reward_raw", pa.float64()),  # weighted sum of reward functions / model, before clipping
        ("score", pa.float64()),  # reward_raw clipped to [-score_clip, score_clip]; null: cannot score
        ("ref_logprobs", LOGPROBS),
        ("kl", LOGPROBS),  # per token, the configured estimator
        ("kl_sum", pa.float64()),
        ("kl_coef", pa.float64()),
        ("reward", pa.float64()),  # score - kl_coef * kl_sum when KL is in the reward
    ]
)

ADVANTAGES = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("prompt_id", pa.string()),
        ("input_ids", TOKENS),  # prompt + response
        ("prompt_len", pa.int32()),
        ("behavior_logprobs", LOGPROBS),
        ("ref_logprobs", LOGPROBS),
        ("advantage", pa.float32()),
        ("reward", pa.float64()),
        ("group_size", pa.int32()),
        ("group_mean", pa.float64()),
        ("group_std", pa.float64()),
    ]
)

# advantage.estimator = "opd": the scores carry the teacher's log-probs (score.teacher_model) and
# the advantages one advantage per response token, which train uses instead of `advantage`;
# absent from the other estimators' tables
TEACHER = pa.schema([("teacher_logprobs", LOGPROBS)])
TOKEN_ADVANTAGES = pa.schema([("token_advantages", LOGPROBS)])

# Multi-turn rollouts (generate.environment, docs/multi-turn.md): beside ROLLOUTS, response_ids
# then holds every token after the prompt, the environment's included; absent from single-turn
# rollouts (readers take a missing loss_mask as all ones). The advantages carry `loss_mask`.
LOSS_MASK = pa.schema([("loss_mask", pa.list_(pa.int8()))])  # per response token, 1: sampled by the policy
TURNS = pa.schema(
    [
        *LOSS_MASK,
        ("turn_starts", pa.list_(pa.int32())),  # offset in response_ids of each segment, first 0
        ("turn_roles", pa.list_(pa.string())),  # "assistant", "tool" or "user", one per segment
        ("turns", pa.int32()),  # assistant turns
        ("env_error", pa.string()),  # why the environment ended the trajectory early; null: it did not
        ("env_seconds", pa.float64()),  # time spent in the environment's calls
    ]
)
# `turn_rewards`: one per assistant turn, what the environment said the turn earned (Step.reward);
# generated multi-turn rollouts only (advantage.turn_credit = "to_go" reads it, null: all 0.0)
TURN_REWARDS = pa.schema([("turn_rewards", pa.list_(pa.float64()))])
TURN_TEXTS = pa.list_(pa.string())  # `turn_texts`: each segment's tokens decoded (special tokens kept)

METRICS = pa.schema(
    [
        ("step", pa.int32()),
        ("epoch", pa.int32()),
        ("lr", pa.float64()),
        ("loss", pa.float64()),
        ("loss_objective", pa.float64()),
        ("loss_kl_to_ref", pa.float64()),
        ("loss_kl_to_inference", pa.float64()),
        ("loss_entropy", pa.float64()),
        ("clip_fraction", pa.float64()),
        ("kl_approx", pa.float64()),
        ("kl_to_ref", pa.float64()),
        ("entropy", pa.float64()),
        ("ess", pa.float64()),
        ("ratio_mean", pa.float64()),
        ("tis_masked", pa.float64()),  # later: older files lack it (LATER_COLUMNS)
        ("grad_norm", pa.float64()),
        ("tokens", pa.int64()),
        ("sequences", pa.int64()),
        ("tokens_per_s", pa.float64()),
    ]
)

ROLLOUT_STATS = pa.schema(  # train's diagnostics per rollout and epoch (core.objectives.ROW_STATS)
    [
        ("rollout_id", pa.string()),
        ("epoch", pa.int32()),
        ("step", pa.int32()),
        ("tokens", pa.int32()),  # response tokens
        ("ratio_mean", pa.float64()),
        ("ratio_max", pa.float64()),
        ("is_weight", pa.float64()),
        ("clipped_tokens", pa.int32()),
        ("masked_tokens", pa.int32()),
        ("entropy_mean", pa.float64()),
        ("logprob_diff_max", pa.float64()),
    ]
)

AUDIT = pa.schema(  # then audit_<name> (float64) per audit function and a verl one's extra columns
    [
        ("rollout_id", pa.string()),
        ("prompt_id", pa.string()),
        ("topup", pa.int32()),  # the rollout's round: 0, or its dynamic-sampling top-up round
    ]
)
EVAL = pa.schema(  # the rollouts columns of the held-out samples, then their reward and correctness
    [
        *ROLLOUTS,
        ("reward", pa.float64()),  # weighted sum of the eval reward functions; null: cannot score
        ("correct", pa.bool_()),  # reward >= eval.correct_threshold; null when reward is null
    ]
)

STAGE_SCHEMAS = {"rollouts": ROLLOUTS, "scores": SCORES, "advantages": ADVANTAGES, "train": METRICS}
STAGE_SCHEMAS["eval"] = EVAL


# Columns added after SCHEMA_VERSION 1 without changing it: nullable, and a file written before
# them is read without them (its readers see the column as null; a new file read by an older
# rlhf-batch is an extra column, passed through).
LATER_COLUMNS = frozenset({"tis_masked"})


def validate(actual: pa.Schema, expected: pa.Schema, where: str) -> None:
    """Fail naming `where` and the column unless every expected column exists with its type, and
    naming the version when the file was written with another SCHEMA_VERSION (a file without the
    key, written by another tool, is read by its columns alone)."""
    version = (actual.metadata or {}).get(VERSION_KEY)
    if version is not None and version != str(SCHEMA_VERSION).encode():
        raise SchemaError(
            f"{where}: written with table schema version {version.decode(errors='replace')}; "
            f"this rlhf-batch reads version {SCHEMA_VERSION}"
        )
    for f in expected:
        idx = actual.get_field_index(f.name)
        if idx < 0 and f.name in LATER_COLUMNS:
            continue
        if idx < 0:
            raise SchemaError(f"{where}: missing column '{f.name}' ({f.type})")
        got = actual.field(idx).type
        if not got.equals(f.type):
            raise SchemaError(f"{where}: column '{f.name}' has type {got}, expected {f.type}")


ENUMS = {"finish_reason": ("stop", "length")}  # columns that hold one of a few strings
UNIQUE = "rollout_id"  # one row per rollout in every stage table
# but preference pairs (train.objective "dpo"): a row per pair a rollout is in, one per (pair, chosen)
PAIR_KEY = ("pair", "chosen")


def check_values(t: pa.Table, where: str) -> None:
    """What a schema cannot say: enum columns hold only their values, no rollout_id repeats (in
    preference pairs no (pair, chosen) repeats)."""
    import pyarrow.compute as pc

    for name, allowed in ENUMS.items():
        if name in t.column_names:
            bad = pc.invert(pc.fill_null(pc.is_in(t[name], pa.array(allowed)), False))
            if pc.any(bad).as_py():
                i = pc.index(bad, True).as_py()
                value = t[name][i].as_py()
                raise SchemaError(
                    f"{where}: column '{name}' holds {value!r} in row {i}; expected one of {', '.join(allowed)}"
                )
    if all(k in t.column_names for k in PAIR_KEY):
        key = pc.add(pc.multiply(pc.cast(t["pair"], pa.int64()), 2), pc.cast(t["chosen"], pa.int64()))
        if pc.count_distinct(key).as_py() < t.num_rows:
            raise SchemaError(f"{where}: a (pair, chosen) occurs more than once")
    elif UNIQUE in t.column_names and pc.count_distinct(t[UNIQUE]).as_py() < t.num_rows:
        counts = pc.value_counts(t[UNIQUE])
        dup = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        raise SchemaError(f"{where}: rollout_id {dup} occurs more than once")


def with_extra(base: pa.Schema, extra: pa.Schema) -> pa.Schema:
    """`base` followed by the fields of `extra` that `base` does not have."""
    fields = list(base) + [f for f in extra if base.get_field_index(f.name) < 0]
    return pa.schema(fields)
