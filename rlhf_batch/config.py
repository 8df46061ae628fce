"""Typed configuration: one dataclass per stage plus run-level settings, loaded from TOML.

A config file has top-level run keys and one table per stage::

    run_dir = "runs/demo"
    policy_model = "{run_dir}/models/policy"
    [generate]
    num_generations = 8

`--set generate.temperature=0.7` and `--set seed=3` override any key. Unknown keys and values
of the wrong type are errors that name the key. Paths may use `{run_dir}`; relative paths in
the file are resolved against the file's directory, relative paths given with --set against the
current directory.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlhf_batch.errors import ConfigError, UserError


def knob(default: Any, *decides: str) -> Any:
    """A config field and the stages whose result it decides (`decides`: stage names). Those
    stages record it in their manifests and compare it on a re-run (Config.identity): changing it
    refuses their complete folders. A field that decides nothing (`knob(x)`) is never compared."""
    meta = {"decides": decides}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# while check_config runs: every problem is recorded here and loading goes on (`validate`)
_PROBLEMS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("config_problems", default=None)


def _fail(message: str) -> None:
    """A config problem: raised, or recorded when check_config collects every problem."""
    found = _PROBLEMS.get()
    if found is None:
        raise ConfigError(message)
    found.append(message)


def _is_ref(ref: str) -> bool:
    """'module:attribute' with dotted identifiers on both sides."""
    mod, _, attr = ref.partition(":")
    return all(p.isidentifier() for p in mod.split(".")) and all(p.isidentifier() for p in attr.split("."))


def _need(ok: bool, key: str, what: str) -> None:
    if not ok:
        _fail(f"'{key}' {what}")


SIDE_DEVICE = re.compile(r"(cpu|cuda(:\d+(,\d+)*)?)?")


def _need_side(device: str, threads: int, table: str) -> None:
    _need(
        SIDE_DEVICE.fullmatch(device) is not None,
        f"{table}.device",
        'must be "", "cpu", "cuda" or "cuda:0,1,..."',
    )
    _need(threads >= 0, f"{table}.threads", "must be >= 0 (0: the run's threads)")


PROMPT_STATS_COLUMNS = {  # the prompt_stats view (sql/prompt_stats.sql)
    "prompt_id": "VARCHAR",
    "attempts": "BIGINT",
    "mean_score": "DOUBLE",
    "pass_rate": "DOUBLE",
    "last_iter": "INTEGER",
}


def prompt_filter_problem(value: str | list[float]) -> str:
    """Why `generate.prompt_filter` is wrong ("" when right): a band [lo, hi] with
    0 <= lo <= hi <= 1, or one SQL boolean expression over the prompt_stats columns."""
    if isinstance(value, list):
        if len(value) != 2 or not 0 <= value[0] <= value[1] <= 1:
            return f"must be a pass-rate band [lo, hi] with 0 <= lo <= hi <= 1, got {value}"
        return ""
    from rlhf_batch.sql import predicate_problem

    problem = predicate_problem(value, PROMPT_STATS_COLUMNS)
    return (
        f"is not an SQL predicate over prompt_stats ({', '.join(PROMPT_STATS_COLUMNS)}): {problem}"
        if problem
        else ""
    )


REPLAY_KEYS = ("iterations", "where", "max_share")  # of advantage.replay


def replay_problem(r: dict[str, Any]) -> str:
    """Why `advantage.replay` is wrong ("" when right): iterations >= 1, 0 < max_share < 1, and
    `where` (optional) one SQL expression (its columns are checked by advantage against the
    scored rollouts)."""
    if unknown := sorted(set(r) - set(REPLAY_KEYS)):
        return f"has no key '{unknown[0]}' (keys: {', '.join(REPLAY_KEYS)})"
    w, f = r.get("iterations"), r.get("max_share")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        return f"needs iterations = W >= 1 (the earlier iterations to replay from), got {w!r}"
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f < 1:
        return f"needs max_share = f with 0 < f < 1 (the most replayed rows' share of the rows), got {f!r}"
    return where_problem(r.get("where", "true"))


def where_problem(where: Any) -> str:
    """Why a `where` of advantage.replay or advantage.select is wrong ("" when right): one SQL
    expression that reads nothing but its row's columns (their names are checked by advantage
    against the scored rollouts)."""
    if not isinstance(where, str) or not where.strip():
        return f"where must be an SQL predicate over the scored rollouts' columns, got {where!r}"
    import duckdb

    from rlhf_batch.sql import reads_problem

    if problem := reads_problem(where, ("scored",)):
        return f"where {problem}"
    con = duckdb.connect(":memory:")
    try:
        if len(con.extract_statements(f"SELECT 1 FROM t WHERE ({where})")) != 1:
            return "where must be one SQL expression"
    except duckdb.Error as e:
        return "where: " + next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    finally:
        con.close()
    return ""


SELECT_KEYS = ("best", "min_reward", "where")  # of advantage.select


def select_problem(s: dict[str, Any]) -> str:
    """Why `advantage.select` is wrong ("" when right): best = k >= 1, min_reward a finite
    number, where one SQL predicate (where_problem); at least one of them."""
    if unknown := sorted(set(s) - set(SELECT_KEYS)):
        return f"has no key '{unknown[0]}' (keys: {', '.join(SELECT_KEYS)})"
    best, low = s.get("best"), s.get("min_reward")
    if "best" in s and (isinstance(best, bool) or not isinstance(best, int) or best < 1):
        return f"needs best = k >= 1 (the rows of highest reward kept per prompt), got {best!r}"
    if "min_reward" in s and (
        isinstance(low, bool) or not isinstance(low, int | float) or not math.isfinite(low)
    ):
        return f"needs min_reward = a finite number, got {low!r}"
    return where_problem(s["where"]) if "where" in s else ""


CPU_BATCH_SIZE = 64  # generate.batch_size = "auto" on a CPU (without RLHF_BATCH_GENERATE_MEMORY)


@dataclass
class GenerateConfig:
    # a file (.jsonl, .json, .parquet), a datasets dir, a dir of shards, a glob, a hub dataset id
    # (org/name[:split], from the HF cache), or a list of those (prompt_files.py)
    # or a weighted mixture: [{path = ..., weight = ..., name = ...}, ...] (data/mixtures.py)
    prompts: str | list[str] | list[dict[str, Any]] = knob("", "generate")
    prompt_column: str = knob("prompt", "generate")  # plain-text prompts
    messages_column: str = knob("messages", "generate")  # chat prompts: list of {role, content}
    id_column: str = knob("id", "generate")  # used as prompt_id when present, else a hash of the prompt
    max_prompt_tokens: int = knob(1024, "generate")
    overlong: Literal["error", "truncate_left", "skip"] = knob("error", "generate")
    num_generations: int = knob(8, "generate")  # G samples per prompt
    # B prompts per iteration from a per-epoch seeded shuffle; 0: every prompt, in file order
    prompts_per_iteration: int = knob(0, "generate")
    # curriculum (data/curriculum.py): [lo, hi], a band of pass rates, or an SQL predicate over
    # prompt_stats; a prompt of the batch seen in earlier iterations that fails it is skipped.
    # "": off. Recorded in generate's inputs when on (so off, identities stay as they were)
    prompt_filter: str | list[float] = knob("")
    pass_threshold: float = knob(0.5)  # a scored rollout passes when score > this (prompt_stats)
    # up to this many further batches of the prompt order refill a batch the filter shrank, each
    # source to its quota (curriculum.py); 0: off. Recorded in generate's inputs when > 0
    prompt_filter_refill: int = knob(0)
    # the filter's history: the last W iterations of it (0: every one, from iteration 0). A window
    # keeps what each iteration reads constant over a long run. Recorded in generate's inputs when > 0
    prompt_filter_window: int = knob(0)
    max_new_tokens: int = knob(256, "generate")
    temperature: float = knob(1.0, "generate", "import", "score", "train")
    top_p: float = knob(1.0, "generate")
    top_k: int = knob(0, "generate")  # 0: no top-k filtering
    # rows (prompt x sample) decoded together; "auto": from free device memory on CUDA, 64 on a CPU
    batch_size: int | Literal["auto"] = knob("auto", "generate")
    prompts_per_part: int = knob(256, "generate")  # resume granularity: one part per this many prompts
    engine: Literal["hf", "vllm"] = knob("hf", "generate")  # hf: the built-in sampler; vllm: vllm.LLM
    python: str = knob("")  # interpreter `run` starts the generate stage with (e.g. .venv-vllm/bin/python)
    # vllm: false sends one request per prompt with n = G samples (faster; a row then depends on
    # its group, reproducible for a fixed engine); true: one request and seed per rollout
    seed_per_rollout: bool = knob(True, "generate")
    tensor_parallel_size: int = knob(1, "generate")  # vllm: GPUs one engine spans
    gpu_memory_utilization: float = knob(0.9)  # vllm: share of GPU memory the engine may take
    max_model_len: int = knob(0, "generate")  # vllm: context length to reserve KV cache for; 0: the model's
    enforce_eager: bool = knob(False, "generate")  # vllm: no CUDA graphs (faster start, slower decode)
    # the sample side (generate, score, import): "cpu", "cuda", "cuda:0" or "cuda:0,1" (its CUDA
    # devices); "" and 0: the run's `device` and `threads`
    device: str = knob("")
    threads: int = knob(0)
    # multi-turn (docs/multi-turn.md): "module:factory", factory(row) -> envs.base.Environment;
    # "": single-turn
    environment: str = knob("", "generate")
    max_turns: int = knob(4, "generate")  # assistant turns per trajectory
    max_trajectory_tokens: int = knob(0, "generate")  # response tokens (sampled + environment); 0: no limit
    env_timeout_s: float = knob(30.0, "generate")  # one environment call; 0: no limit
    env_workers: int = knob(2)  # processes the environment steps run in
    # the Python tool (envs/python_tool.py): "required" refuses to run its code where the sandbox
    # (PID, mount and network namespaces) cannot be made; "weak": a process-group kill only
    tool_sandbox: str = knob("required")
    # the tool-call format the built-in tool environment and the completion messages read
    # (envs/tool_calls.py): hermes (Qwen, Hermes), llama3_json (Llama 3.x), mistral
    tool_parser: Literal["hermes", "llama3_json", "mistral"] = knob("hermes", "generate")
    # a part whose trajectories end in env_error more often than this stops the stage (1: never)
    max_env_error_share: float = knob(0.5)

    def validate(self) -> None:
        _need(self.num_generations >= 1, "generate.num_generations", "must be >= 1")
        _need(
            not self.environment or _is_ref(self.environment),
            "generate.environment",
            f"must be 'module:factory', got {self.environment!r}",
        )
        _need(self.max_turns >= 1, "generate.max_turns", "must be >= 1")
        _need(self.max_trajectory_tokens >= 0, "generate.max_trajectory_tokens", "must be >= 0 (0: no limit)")
        _need(self.env_timeout_s >= 0, "generate.env_timeout_s", "must be >= 0 (0: no limit)")
        _need(self.env_workers >= 1, "generate.env_workers", "must be >= 1")
        _need(
            self.tool_sandbox in ("required", "weak"),
            "generate.tool_sandbox",
            f"must be required or weak, got {self.tool_sandbox!r}",
        )
        _need(0 <= self.max_env_error_share <= 1, "generate.max_env_error_share", "must be in [0, 1]")
        _need(self.prompts_per_iteration >= 0, "generate.prompts_per_iteration", "must be >= 0 (0: all)")
        _need(self.max_new_tokens >= 1, "generate.max_new_tokens", "must be >= 1")
        if isinstance(self.prompts, list) and any(isinstance(x, dict) for x in self.prompts):
            from rlhf_batch.core.mixtures import spec_problem as mixture_problem

            problem = mixture_problem(self.prompts, self.prompts_per_iteration)
            _need(not problem, "generate.prompts", problem)
        if self.prompt_filter != "":
            problem = prompt_filter_problem(self.prompt_filter)
            _need(not problem, "generate.prompt_filter", problem)
        _need(self.prompt_filter_refill >= 0, "generate.prompt_filter_refill", "must be >= 0 (0: off)")
        _need(
            self.prompt_filter_window >= 0,
            "generate.prompt_filter_window",
            "must be >= 0 (0: every iteration)",
        )
        _need(
            not self.prompt_filter_refill or (self.prompt_filter != "" and self.prompts_per_iteration > 0),
            "generate.prompt_filter_refill",
            "needs generate.prompt_filter and generate.prompts_per_iteration > 0 (further batches to refill from)",
        )
        _need(self.temperature > 0, "generate.temperature", "must be > 0")
        _need(0 < self.top_p <= 1, "generate.top_p", "must be in (0, 1]")
        _need(self.top_k >= 0, "generate.top_k", "must be >= 0")
        _need(
            self.batch_size == "auto" or self.batch_size >= 1, "generate.batch_size", "must be >= 1 or 'auto'"
        )
        _need(self.prompts_per_part >= 1, "generate.prompts_per_part", "must be >= 1")
        _need(self.max_prompt_tokens >= 1, "generate.max_prompt_tokens", "must be >= 1")
        _need(
            self.engine == "hf" or (self.top_k == 0 and self.top_p == 1),
            "generate.engine",
            "= 'vllm' needs top_k = 0 and top_p = 1: vLLM's log-probs are those after its top-k/top-p filter, "
            "the behaviour log-probs here are those before it (use engine = 'hf' to filter)",
        )
        _need(
            self.seed_per_rollout or self.engine == "vllm",
            "generate.seed_per_rollout",
            "= false is for engine = 'vllm' (the hf sampler always seeds each rollout)",
        )
        _need(self.tensor_parallel_size >= 1, "generate.tensor_parallel_size", "must be >= 1")
        _need(0 < self.gpu_memory_utilization <= 1, "generate.gpu_memory_utilization", "must be in (0, 1]")
        _need(self.max_model_len >= 0, "generate.max_model_len", "must be >= 0 (0: the model's)")
        _need_side(self.device, self.threads, "generate")


@dataclass
class ScoreConfig:
    reward_functions: list[str] = knob([], "score")  # "package.module:function"
    reward_weights: list[float] = knob([], "score")  # default: 1.0 each
    reward_paths: list[str] = knob([])  # where reward modules are imported from (changes no result)
    # seconds a reward function may take on one batch (a part) before the stage fails naming it and
    # the rollouts; 0: no limit. Also eval's. Changes no result (a run that times out has none)
    reward_timeout: float = knob(600.0)
    # keep each function's verdict per rollout content under RUN_DIR/reward_cache and reuse it
    # (score, eval, audit; rewards/cache.py). Changes no result of a per-rollout function
    reward_cache: bool = knob(False)
    reward_concurrency: int = knob(8)  # `async def` functions: calls in flight at once
    reward_rate_per_s: float = knob(0.0)  # `async def` functions: calls started per second; 0: no limit
    # verifiers that never enter the reward: `rlhf-batch audit` writes their columns audit_<name>
    audit_functions: list[str] = knob([], "audit")
    reward_model_weight: float = knob(1.0, "score")
    score_clip: float = knob(0.0, "score")  # clip the score to [-c, c]; 0 disables
    kl_estimator: Literal["k1", "k2", "k3"] = knob("k1", "score")
    kl_in_reward: bool = knob(False, "score")  # on: reward = score - kl_reward_coef * kl_sum (TRL, verl: off)
    kl_controller: Literal["constant", "adaptive"] = knob("constant", "score")
    kl_reward_coef: float = knob(0.05, "score")  # beta (initial beta for the adaptive controller)
    kl_target: float = knob(6.0, "score")  # adaptive controller: target KL per sequence
    kl_horizon: int = knob(10000, "score")  # adaptive controller: horizon in rollouts
    # the token budget changes no result (up to rounding): a resume may lower it after an OOM
    max_tokens_per_batch: int = knob(8192)  # token budget of a forward batch
    rows_per_part: int = knob(2048, "score", "import")
    # on-policy distillation: a model (local dir or hub id) whose log-probs of every sampled token
    # score writes as `teacher_logprobs`; it must share the policy's tokenizer. "": none
    teacher_model: str = knob("", "score")
    # an LLM judge as a reward (stages/score/judge.py): a causal LM (local dir or hub id) whose greedy
    # verdict is stored as `judge_verdict` and the score parsed from it as `judge_score`, weighed
    # into reward_raw by judge_weight. "": none. "" template, rubric or pattern: the mode's default
    judge_model: str = knob("", "score")
    judge_mode: Literal["pointwise", "group"] = knob("pointwise", "score")  # group: RULER-style
    judge_template: str = knob("", "score")  # Python format fields: {prompt} {response} {rubric} ...
    judge_rubric: str = knob("", "score")
    judge_pattern: str = knob("", "score")  # regex: the score (pointwise); response number, score (group)
    judge_parser: str = knob("", "score")  # "module:function" from the verdict text to the score(s)
    judge_weight: float = knob(1.0, "score")
    judge_max_new_tokens: int = knob(64, "score")

    def validate(self) -> None:
        if self.judge_model:
            from rlhf_batch.core.verdicts import pattern_problem, template_problem

            _need(self.judge_max_new_tokens >= 1, "score.judge_max_new_tokens", "must be >= 1")
            _need(math.isfinite(self.judge_weight), "score.judge_weight", "must be a finite number")
            if self.judge_pattern and (problem := pattern_problem(self.judge_pattern, self.judge_mode)):
                _fail(problem)
            _need(
                not self.judge_parser or _is_ref(self.judge_parser),
                "score.judge_parser",
                "must be 'module:function'",
            )
            problem = template_problem(self.judge_template, self.judge_mode, ())
            if problem and "no field" not in problem:  # the prompt file's columns: checked by score
                _fail(problem)
        _need(self.reward_timeout >= 0, "score.reward_timeout", "must be >= 0 (0: no limit)")
        _need(self.reward_concurrency >= 1, "score.reward_concurrency", "must be >= 1")
        _need(
            math.isfinite(self.reward_rate_per_s) and self.reward_rate_per_s >= 0,
            "score.reward_rate_per_s",
            "must be a finite number >= 0 (0: no limit)",
        )
        _need(
            not self.reward_weights or len(self.reward_weights) == len(self.reward_functions),
            "score.reward_weights",
            f"has {len(self.reward_weights)} weights for {len(self.reward_functions)} reward_functions",
        )
        _need(self.score_clip >= 0, "score.score_clip", "must be >= 0")
        _need(self.kl_reward_coef >= 0, "score.kl_reward_coef", "must be >= 0")
        _need(self.kl_target > 0, "score.kl_target", "must be > 0")
        _need(self.kl_horizon > 0, "score.kl_horizon", "must be > 0")
        _need(self.max_tokens_per_batch >= 1, "score.max_tokens_per_batch", "must be >= 1")
        _need(self.rows_per_part >= 1, "score.rows_per_part", "must be >= 1")


@dataclass
class AdvantageConfig:
    # (r-mean)/(std+eps) | r-mean | leave-one-out | on-policy distillation (per token: teacher -
    # behaviour log-prob, plus opd_task_weight x the grpo advantage; needs score.teacher_model)
    estimator: Literal["grpo", "drgrpo", "rloo", "opd"] = knob("grpo", "advantage")
    opd_task_weight: float = knob(0.0, "advantage")  # opd: weight of the task reward's grpo advantage
    # opd: "mean" subtracts the iteration's mean teacher - behaviour log-prob over its sampled
    # tokens (loss_mask 1 on multi-turn rows; a constant baseline: unbiased, and the signal is then which tokens the teacher
    # prefers, not how far below it the student is everywhere); "none" keeps the raw difference
    opd_baseline: Literal["mean", "none"] = knob("mean", "advantage")
    scale: Literal["group", "batch", "none"] = knob("group", "advantage")  # grpo's std: group, batch, none
    # "sum": the advantage of reward (reward_raw's weighted sum); "per_part" (GDPO): each part of
    # reward_raw (reward function, reward model, judge) normalised within its group, then weighed
    # and summed (stages/advantage.py)
    reward_normalization: Literal["sum", "per_part"] = knob("sum", "advantage")
    # multi-turn rows: "trajectory" (every sampled token gets the trajectory's advantage, as TRL
    # and verl do) or "to_go" (an assistant turn's tokens get the advantage of what the trajectory
    # earned from that turn on: its reward minus the environment's `turn_rewards` of the turns
    # before, normalised among the group's rows that reached the turn; core/turn_credit.py).
    # Recorded in advantage's identity when "to_go"
    turn_credit: Literal["trajectory", "to_go"] = knob("trajectory")
    # to_go: turn k's return is sum over j >= k of turn_discount^(j - k) x what turn j earned
    # (1: everything from turn k on; 0: turn k's own earning). Recorded with turn_credit
    turn_discount: float = knob(1.0)
    ddof: int = knob(1, "advantage")  # std: 1 sample (stddev_samp, as TorchRL's MCAdvantage), 0 population
    eps: float = knob(1e-6, "advantage")  # added to the std (TorchRL's MCAdvantage default)
    window: int = knob(1, "advantage")  # pool groups over the last W iterations
    drop_zero_variance: bool = knob(True, "advantage")  # drop groups whose rewards are all equal (DAPO)
    min_group_size: int = knob(2, "advantage")  # drop groups with fewer scored rollouts
    truncated: Literal["keep", "drop", "zero"] = knob("keep", "advantage")  # finish_reason = 'length'
    bucket_tokens: int = knob(64, "advantage")  # width of a length bucket
    # dynamic sampling: fewer informative groups than this after the filters -> a top-up round
    # of generate + score (the next prompts of the order); 0: off
    min_groups: int = knob(0, "advantage")
    max_topup_rounds: int = knob(2, "advantage")  # the cap on top-up rounds per iteration
    rows_per_part: int = knob(4096, "advantage")
    # the rows of the iterations train.objective trains with "sft" (stages/advantage.py):
    # {best = k, min_reward = x, where = "<SQL predicate>"}, any of them, all must hold: the k rows
    # of highest reward per prompt, a reward >= x, the predicate over the scored rollout's columns
    # (rollouts and scores). {}: off. Recorded in advantage's identity on SFT iterations
    select: dict[str, Any] = field(default_factory=dict, metadata={"decides": ()})
    # the preference pairs of "dpo" iterations, per prompt: "best_worst" (its best row against its
    # worst) or "all" (every two rows); the chosen row's reward must exceed the rejected one's by
    # more than pair_margin. Recorded in advantage's identity on DPO iterations
    pairs: Literal["best_worst", "all"] = knob("best_worst")
    pair_margin: float = knob(0.0)
    # replay (stages/replay.py): {iterations = W, where = "<SQL predicate>", max_share = f}: stored
    # training rows of up to W earlier iterations join this one's; {}: off. Recorded in advantage's
    # inputs when on (so off, identities stay as they were)
    replay: dict[str, Any] = field(default_factory=dict, metadata={"decides": ()})

    def validate(self) -> None:
        if self.replay:
            problem = replay_problem(self.replay)
            _need(not problem, "advantage.replay", problem)
        if self.select:
            problem = select_problem(self.select)
            _need(not problem, "advantage.select", problem)
        _need(
            math.isfinite(self.pair_margin) and self.pair_margin >= 0,
            "advantage.pair_margin",
            "must be a finite number >= 0",
        )
        _need(self.ddof in (0, 1), "advantage.ddof", "must be 0 or 1")
        _need(
            math.isfinite(self.turn_discount) and 0 <= self.turn_discount <= 1,
            "advantage.turn_discount",
            "must be a number in [0, 1]",
        )
        if self.turn_credit == "to_go":
            for ok, key, why in (
                (self.estimator != "opd", "advantage.estimator", "'opd' has per-token advantages of its own"),
                (
                    self.reward_normalization == "sum",
                    "advantage.reward_normalization",
                    "'per_part' is not per turn",
                ),
                (self.window == 1, "advantage.window", "turns are normalised within this iteration's groups"),
                (not self.replay, "advantage.replay", "replayed rows carry no turn credit"),
            ):
                _need(ok, key, f"cannot be used with advantage.turn_credit = 'to_go': {why}")
        _need(self.eps >= 0, "advantage.eps", "must be >= 0")
        _need(
            self.scale == "group" or self.estimator in ("grpo", "opd"),
            "advantage.scale",
            f"is used only with advantage.estimator = 'grpo' or 'opd' ('{self.estimator}' divides by no std)",
        )
        _need(self.window >= 1, "advantage.window", "must be >= 1")
        _need(self.min_group_size >= 1, "advantage.min_group_size", "must be >= 1")
        _need(self.bucket_tokens >= 1, "advantage.bucket_tokens", "must be >= 1")
        _need(self.min_groups >= 0, "advantage.min_groups", "must be >= 0 (0: off)")
        _need(self.max_topup_rounds >= 0, "advantage.max_topup_rounds", "must be >= 0")
        _need(self.rows_per_part >= 1, "advantage.rows_per_part", "must be >= 1")
        _need(
            math.isfinite(self.opd_task_weight) and self.opd_task_weight >= 0,
            "advantage.opd_task_weight",
            "must be a finite number >= 0 (0: pure distillation)",
        )
        _need(
            self.opd_task_weight == 0 or self.estimator == "opd",
            "advantage.opd_task_weight",
            "is used only with advantage.estimator = 'opd'",
        )


@dataclass
class TrainConfig:
    # what train fits (core/objective_schedule.py): "grpo" (the policy-gradient loss below), "sft"
    # (token cross-entropy on the rows advantage.select keeps), "dpo" (preference pairs,
    # advantage.pairs); or a schedule, e.g. ["sft:3", "grpo"]. Recorded per iteration when not grpo
    objective: str | list[str] = knob("grpo")
    dpo_beta: float = knob(0.1)  # DPO's beta (TRL's DPOConfig.beta); IPO's tau
    dpo_loss: Literal["sigmoid", "ipo"] = knob("sigmoid")  # TRL's DPOConfig.loss_type
    ppo_epochs: int = knob(1, "train")
    lr: float = knob(1e-5, "train")
    weight_decay: float = knob(0.0, "train")
    warmup_steps: int = knob(0, "train")  # over the run's optimizer steps (once per run)
    lr_schedule: Literal["constant", "cosine", "linear"] = knob("constant", "train")
    # the schedule's length in optimizer steps over the whole run; 0: iterations x the steps of the
    # first iteration that trains (recorded with the optimizer state and kept from then on)
    total_steps: int = knob(0, "train")
    # true: train starts AdamW and the schedule afresh instead of continuing the previous iteration's
    # optimizer state (which is an error to lose otherwise); recorded in the train manifest
    fresh_optimizer: bool = knob(False)
    # the dtype of the AdamW moments in the state carried to the next iteration: "bfloat16" halves
    # its bytes (written, read, kept in memory) and rounds the moments at every iteration boundary
    optimizer_state_dtype: Literal["float32", "bfloat16"] = knob("float32", "train")
    max_grad_norm: float = knob(1.0, "train")
    tokens_per_step: int = knob(65536, "train")  # real tokens per optimizer step (global)
    sequences_per_step: int = knob(0, "train")  # rollouts per optimizer step (global); 0: tokens_per_step
    max_tokens_per_batch: int = knob(16384, "train")  # token budget of one micro-batch
    max_padding: float = knob(0.1, "train")  # close a micro-batch before padding exceeds this share
    eps_low: float = knob(0.2, "train")
    eps_high: float = knob(0.0, "train")  # 0: same as eps_low
    dual_clip: float = knob(0.0, "train")  # 0: off; else c > 1
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = knob(
        "token_mean", "train"
    )
    norm_const: float = knob(0.0, "train")  # seq_mean_token_sum_norm divisor; 0: generate.max_new_tokens
    kl_loss_coef: float = knob(0.0, "train")  # k3 KL to the reference in the loss
    kl_to_inference_coef: float = knob(0.0, "train")
    # weight tokens by min(pi_old / pi_behaviour, cap) (TIS); 0: off. Unset: 0, or STALE_TIS_CAP
    # with max_staleness > 0 and recompute_old (resolve_objective)
    tis_cap: float | None = knob(None, "train")
    # the objective (docs/stages.md "train"): the importance ratio of each token or of its row (GSPO,
    # with its own clip range seq_eps_low / seq_eps_high), the clipped PPO surrogate or CISPO's
    # truncated stop-gradient weight (cispo_max), and how the engine/trainer weight is bounded
    ratio_level: Literal["token", "sequence"] = knob("token", "train")
    seq_eps_low: float = knob(3e-4, "train")  # GSPO's clip range (its authors, verl's examples)
    seq_eps_high: float = knob(4e-4, "train")
    loss: Literal["ppo", "cispo"] = knob("ppo", "train")
    cispo_max: float = knob(5.0, "train")  # CISPO's weight bound (TRL's epsilon_high for cispo, ScaleRL)
    # truncate: min(w, tis_cap); mask: tokens with w outside [tis_low, tis_cap] dropped (ICE-POP);
    # sequence_mask: rows whose product ratio leaves [tis_low, tis_cap] dropped. A mask mode with
    # tis_cap unset: MASK_TIS_CAP (resolve_objective)
    tis_mode: Literal["truncate", "mask", "sequence_mask"] = knob("truncate", "train")
    tis_low: float = knob(0.0, "train")
    entropy_coef: float = knob(0.0, "train")
    # the old log-probs (the proximal anchor of the clip) recomputed by the trainer at the start of
    # the iteration instead of the behaviour ones; unset: on exactly when max_staleness > 0
    recompute_old: bool | None = knob(None, "train")
    gradient_checkpointing: bool = knob(False, "train")
    autocast_bf16: bool = knob(True, "train")  # bf16 autocast when dtype resolves to bfloat16
    checkpoint_every: int = knob(0, "train")  # optimizer steps; 0: only at the end
    fsdp: bool = knob(False, "train")  # under torchrun: shard weights, gradients, AdamW state (FSDP2)
    # the learn side (advantage, train, eval): as generate.device / generate.threads
    device: str = knob("")
    threads: int = knob(0)

    def validate(self) -> None:
        _need(self.ppo_epochs >= 1, "train.ppo_epochs", "must be >= 1")
        _need(0 <= self.lr <= 1, "train.lr", "must be in [0, 1]")
        _need(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _need(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _need(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0: no clipping)")
        _need(self.eps_high >= 0, "train.eps_high", "must be >= 0 (0: same as eps_low)")
        _need(self.norm_const >= 0, "train.norm_const", "must be >= 0")
        _need(self.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
        _need(self.total_steps >= 0, "train.total_steps", "must be >= 0 (0: estimated)")
        _need(self.eps_low > 0, "train.eps_low", "must be > 0")
        _need(self.tis_cap in (None, 0) or self.tis_cap >= 1, "train.tis_cap", "must be 0 (off) or >= 1")
        _need(self.dual_clip == 0 or self.dual_clip > 1, "train.dual_clip", "must be 0 (off) or > 1")
        _need(self.tokens_per_step >= 1, "train.tokens_per_step", "must be >= 1")
        _need(self.sequences_per_step >= 0, "train.sequences_per_step", "must be >= 0 (0: tokens_per_step)")
        _need(self.max_tokens_per_batch >= 1, "train.max_tokens_per_batch", "must be >= 1")
        _need(0 < self.max_padding <= 1, "train.max_padding", "must be in (0, 1]")
        self._validate_objective()
        _need_side(self.device, self.threads, "train")
        from rlhf_batch.core.objective_schedule import parse_schedule

        try:
            parse_schedule(self.objective)
        except ValueError as e:
            _fail(f"'train.objective' {e}")
        _need(
            math.isfinite(self.dpo_beta) and self.dpo_beta > 0,
            "train.dpo_beta",
            "must be a finite number > 0",
        )

    def _validate_objective(self) -> None:
        """GSPO, CISPO and the importance-sampling modes: their bounds and their bad combinations."""
        _need(self.seq_eps_low > 0, "train.seq_eps_low", "must be > 0")
        _need(self.seq_eps_high >= 0, "train.seq_eps_high", "must be >= 0 (0: same as seq_eps_low)")
        _need(self.cispo_max > 0, "train.cispo_max", "must be > 0")
        _need(0 <= self.tis_low < 1, "train.tis_low", "must be in [0, 1) (the band's lower bound)")
        seq, cispo = self.ratio_level == "sequence", self.loss == "cispo"
        _need(
            not (seq and cispo),
            "train.loss",
            "'cispo' weighs token ratios: it needs train.ratio_level = 'token'",
        )
        _need(
            not (seq and self.aggregation != "seq_mean_token_mean"),
            "train.ratio_level",
            "'sequence' (GSPO) needs train.aggregation = 'seq_mean_token_mean', as its authors and verl aggregate",
        )
        _need(
            not ((seq or cispo) and self.dual_clip),
            "train.dual_clip",
            "applies to the token-level PPO surrogate only (train.loss 'ppo', train.ratio_level 'token')",
        )
        _need(
            self.tis_mode != "truncate" or self.tis_low == 0,
            "train.tis_low",
            "bounds the band of tis_mode 'mask' / 'sequence_mask'; truncation has no lower bound",
        )
        _need(
            self.tis_mode == "truncate" or self.tis_cap != 0,
            "train.tis_cap",
            f"is the upper bound of tis_mode '{self.tis_mode}': leave it unset or set it >= 1",
        )


# The upper bound of the importance-weight band of the mask modes (tis_mode "mask" / "sequence_mask")
# when tis_cap is unset: TRL's vllm_importance_sampling_clip_max default.
MASK_TIS_CAP = 3.0

# The truncation cap of the importance weight pi_old / pi_behaviour when rollouts may be stale
# (max_staleness > 0). AReaL, whose decoupled objective this is, caps that weight at 5 in every
# asynchronous example (and had 5 as its default); TRL's caps (2, then 3) bound the small
# engine/trainer mismatch of on-policy rollouts, where S policy updates move the policy further.
# docs/stages.md, "Stale rollouts", has the comparison.
STALE_TIS_CAP = 5.0


def resolve_objective(tc: TrainConfig, max_staleness: int, replay: bool = False) -> None:
    """`train.recompute_old` and `train.tis_cap` left unset: the decoupled objective (recompute on,
    cap STALE_TIS_CAP) when rollouts may be stale (max_staleness > 0), else off and 0, as before.
    A value set in the config is kept; with recompute_old = false there is no anchor to weigh
    against, so the cap stays 0."""
    stale = max_staleness > 0 or replay  # advantage.replay: rows of earlier policies
    if tc.recompute_old is None:
        tc.recompute_old = stale
    if tc.tis_cap is None and tc.tis_mode != "truncate":
        tc.tis_cap = MASK_TIS_CAP
    if tc.tis_cap is None:
        tc.tis_cap = STALE_TIS_CAP if stale and tc.recompute_old else 0.0


Tracker = Literal["tensorboard", "trackio", "wandb", "mlflow"]
TRACKER_MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}


def missing_trackers(report_to: list[Tracker]) -> str | None:
    """One line naming the first configured tracker that is not installed, or None."""
    import importlib.util

    for name in report_to:
        if importlib.util.find_spec(TRACKER_MODULES[name]) is None:
            return f"'{name}', which is not installed: pip install 'rlhf-batch[{name}]'"
    return None


@dataclass
class EvalConfig:
    """Held-out evaluation (stage `eval`): n samples per prompt from iteration K's starting policy."""

    prompts: str | list[str] = knob("", "eval")  # held-out prompts (any form generate reads); empty: no eval
    n: int = knob(4, "eval")  # samples per prompt
    k: list[int] = knob([1], "eval")  # pass@k for each k (1 <= k <= n)
    correct_threshold: float = knob(1.0, "eval")  # a sample is correct when its judge's value >= this
    # the reward function that judges correctness (its column name without reward_, or its path);
    # "": the first of the eval reward functions
    correct_function: str = knob("", "eval")
    temperature: float = knob(1.0, "eval")
    top_p: float = knob(1.0, "eval")
    top_k: int = knob(0, "eval")  # 0: no top-k filtering
    max_new_tokens: int = knob(0, "eval")  # 0: generate.max_new_tokens
    reward_functions: list[str] = knob([], "eval")  # default: score.reward_functions (and weights)
    reward_weights: list[float] = knob([], "eval")  # default: 1.0 each
    every: int = knob(0)  # run evaluates 0, every, 2 * every, ... and after the last (0: 0 and last)
    prompts_per_part: int = knob(64, "eval")

    def validate(self) -> None:
        _need(self.n >= 1, "eval.n", "must be >= 1")
        _need(bool(self.k), "eval.k", "must name at least one k")
        for k in self.k:
            _need(1 <= k <= self.n, "eval.k", f"has k = {k}; pass@k needs 1 <= k <= eval.n = {self.n}")
        _need(self.temperature > 0, "eval.temperature", "must be > 0")
        _need(0 < self.top_p <= 1, "eval.top_p", "must be in (0, 1]")
        _need(self.top_k >= 0, "eval.top_k", "must be >= 0")
        _need(self.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0 (0: generate.max_new_tokens)")
        _need(self.every >= 0, "eval.every", "must be >= 0")
        _need(self.prompts_per_part >= 1, "eval.prompts_per_part", "must be >= 1")
        _need(
            not self.reward_weights or len(self.reward_weights) == len(self.reward_functions),
            "eval.reward_weights",
            f"has {len(self.reward_weights)} weights for {len(self.reward_functions)} reward_functions",
        )


@dataclass
class LoraConfig:
    """LoRA policies (peft): train updates only the adapter; each policy is the adapter plus its
    merged full weights (docs/lora.md)."""

    enabled: bool = knob(False, "train")
    r: int = knob(8, "train")  # rank of the update B @ A
    alpha: int = knob(16, "train")  # the update is scaled by alpha / r
    dropout: float = knob(0.0, "train")  # on the adapter's input, in training only
    target_modules: list[str] = knob(["all-linear"], "train")  # module names, or ["all-linear"]
    init_adapter: str = knob("", "train")  # a peft adapter dir iteration 0 starts from

    def validate(self) -> None:
        _need(self.r >= 1, "lora.r", "must be >= 1")
        _need(self.alpha > 0, "lora.alpha", "must be > 0")
        _need(0 <= self.dropout < 1, "lora.dropout", "must be in [0, 1)")
        _need(bool(self.target_modules), "lora.target_modules", 'must name modules, or be ["all-linear"]')
        _need(not self.init_adapter or self.enabled, "lora.init_adapter", "needs lora.enabled = true")


SAMPLE_SIDE = ("generate", "score", "import")  # the stages generate.device/threads apply to


@dataclass
class Config:
    run_dir: str = knob("runs/default", "generate", "train")
    seed: int = knob(0, "generate", "advantage", "train")
    iterations: int = knob(1)
    epochs: int = knob(0)  # > 0: size the run in passes over the prompt set instead (overrides iterations)
    policy_model: str = knob("", "generate", "train")  # initial policy (iteration 0)
    ref_model: str = knob("")  # default: the initial policy (score records the resolved one)
    reward_model: str = knob("", "score")  # optional sequence-classification model (1 label)
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "generate", "train")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "generate", "import", "score", "train"
    )
    trust_remote_code: bool = knob(False, "generate", "train")
    # CPU threads for torch; 0: one per CPU this process may use (resolved when the config loads).
    # The thread count changes float rounding, so it is part of the model stages' identity.
    threads: int = knob(0, "generate", "import", "score", "train")
    in_process: bool = knob(False)  # run: stages in this process instead of one subprocess each
    fsync: bool = knob(
        True
    )  # fsync what stages write; false: a kill is still safe, a power cut may lose the last writes
    demo: bool = knob(False)  # generate: build the tiny demo model and prompts when missing
    report_to: list[Tracker] = knob([])  # live tracking (docs/inspecting.md: Live tracking)
    run_name: str = knob("")  # trackers' run name; default: the run_dir's folder name
    tracking_project: str = knob("")  # wandb/trackio project, MLflow experiment; default "rlhf-batch"
    keep_policies: int = knob(0)  # keep the policies of the last N trained iterations; 0: keep all
    # overlapped iterations: iteration K generates with the policy of iteration K-1-S (the initial
    # policy while that is negative), so `run` samples ahead while it trains; 0: lock-step
    max_staleness: int = knob(0)  # decides through the policy generate samples from (its input)
    keep_every: int = knob(0)  # with keep_policies: also keep iterations 0, M, 2M, ...; 0: none
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        # replay's rows are stale too (stages/replay.py): the decoupled objective's defaults
        resolve_objective(self.train, self.max_staleness, bool(self.advantage.replay))

    def side(self, stage: str) -> tuple[str, int, str | None]:
        """(device, threads, CUDA devices or None) that `stage` runs with: generate.device/threads
        for the sample side (generate, score, import), train's for the rest, else the run's."""
        table = self.generate if stage in SAMPLE_SIDE else self.train
        device, cuda = table.device or self.device, None
        if device.startswith("cuda:"):
            device, cuda = "cuda", device.removeprefix("cuda:")
        return device, table.threads or self.threads, cuda

    @property
    def ref(self) -> str:
        return self.ref_model or self.policy_model

    def objective(self, iteration: int) -> str:
        """What train fits in `iteration`: train.objective's entry for it (grpo, sft, dpo)."""
        from rlhf_batch.core.objective_schedule import objective_at, parse_schedule

        return objective_at(parse_schedule(self.train.objective), iteration)

    def uses_objective(self, objective: str) -> bool:
        """Whether some iteration of train.objective is `objective`."""
        from rlhf_batch.core.objective_schedule import parse_schedule, uses

        return uses(parse_schedule(self.train.objective), objective)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self, stage: str) -> dict[str, Any]:
        """The keys that decide `stage`'s result (their `decides` metadata): run-level keys at the
        top, table keys under their table."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                fields = dataclasses.fields(value)
                table = {g.name: getattr(value, g.name) for g in fields if stage in g.metadata["decides"]}
                if table.get("batch_size") == "auto" and not self.samples_on_cuda():
                    table["batch_size"] = CPU_BATCH_SIZE  # "auto" on a CPU: the old default, same identity
                if table.get("seed_per_rollout") is True:
                    del table["seed_per_rollout"]  # recorded only when off: older identities stay
                if table.get("environment") == "":  # single-turn: older identities stay
                    for k in ("environment", "max_turns", "max_trajectory_tokens", "env_timeout_s"):
                        del table[k]
                if table.get("tool_parser") == "hermes" or "environment" not in table:
                    table.pop("tool_parser", None)  # recorded only when not the default: identities stay
                if table:
                    out[f.name] = table
            elif stage in f.metadata["decides"]:
                out[f.name] = value
        return out

    def samples_on_cuda(self) -> bool:
        """Whether the sample side (generate's device, else the run's) is a CUDA device."""
        device = self.generate.device or self.device
        if device == "auto":
            from rlhf_batch.runtime.device import resolve_device

            device = resolve_device(device)
        return device.startswith("cuda")

    def validate(self) -> None:
        _need(self.iterations >= 1, "iterations", "must be >= 1")
        _need(self.epochs >= 0, "epochs", "must be >= 0 (0: the run is sized by iterations)")
        _need(self.threads >= 0, "threads", "must be >= 0")
        _need(not (gone := missing_trackers(self.report_to)), "report_to", f"asks for {gone}")
        _need(self.keep_policies >= 0, "keep_policies", "must be >= 0")
        _need(self.keep_every >= 0, "keep_every", "must be >= 0")
        _need(self.max_staleness >= 0, "max_staleness", "must be >= 0 (0: lock-step)")
        _need(
            self.keep_policies == 0 or self.keep_policies > self.max_staleness,
            "keep_policies",
            f"must be 0 or > max_staleness ({self.max_staleness}): generate still samples from "
            f"the policy {self.max_staleness} iterations back",
        )
        for table in (self.generate, self.score, self.advantage, self.train, self.eval, self.lora):
            table.validate()
        if self.lora.enabled:
            _need(
                not self.ref_model or self.ref_model == self.policy_model,
                "ref_model",
                "must be empty with [lora]: the reference is policy_model, the base with the adapter disabled",
            )
            _need(not self.train.fsdp, "train.fsdp", "is not supported with [lora]")
        _need(
            self.advantage.estimator != "opd" or bool(self.score.teacher_model),
            "advantage.estimator",
            "= 'opd' needs score.teacher_model (the teacher whose log-probs it distils)",
        )
        self._validate_objectives()
        _need(
            self.advantage.reward_normalization == "sum" or not self.score.kl_in_reward,
            "advantage.reward_normalization",
            "= 'per_part' normalises reward_raw's parts: it cannot be used with score.kl_in_reward "
            "(use train.kl_loss_coef for the KL)",
        )

    def _validate_objectives(self) -> None:
        """train.objective's SFT and DPO iterations against the advantage settings they use."""
        from rlhf_batch.core.objective_schedule import parse_schedule, uses

        try:
            schedule = parse_schedule(self.train.objective)
        except ValueError:
            return  # TrainConfig.validate said why
        sft, dpo = uses(schedule, "sft"), uses(schedule, "dpo")
        _need(
            not sft or bool(self.advantage.select),
            "train.objective",
            "'sft' trains on the rows advantage.select keeps: set it, e.g. {best = 1} (best-of-G per prompt)",
        )
        _need(
            sft or not self.advantage.select,
            "advantage.select",
            "chooses the rows of train.objective's 'sft' iterations, and it has none",
        )
        _need(
            not (sft or dpo) or self.advantage.estimator != "opd",
            "train.objective",
            "'sft' and 'dpo' learn from whole rows: they cannot be used with advantage.estimator = 'opd'",
        )
        _need(
            not (sft or dpo) or not self.advantage.replay,
            "advantage.replay",
            "replays GRPO rows: it cannot be used with train.objective 'sft' or 'dpo'",
        )


RENAMED = {  # old key -> new key: an old name is refused, naming the new one
    "score.kl_coef": "score.kl_reward_coef",
    "train.kl_coef": "train.kl_loss_coef",
    "advantage.rows_per_shard": "advantage.rows_per_part",
}
# Keys of TRL's GRPOConfig and verl's actor config that users bring, in any table: refused with
# ours (never a "did you mean" guessed from the spelling). name -> (where it comes from, our key,
# {their value: our setting}) (docs/configuration.md "Names from TRL and verl").
_SEQ_MEAN, _TOKEN_MEAN = "train.aggregation = 'seq_mean_token_mean'", "train.aggregation = 'token_mean'"
FOREIGN: dict[str, tuple[str, str, dict[Any, str]]] = {
    "importance_sampling_level": (
        "TRL",
        "train.ratio_level",
        {"token": "train.ratio_level = 'token'", "sequence": "train.ratio_level = 'sequence' (GSPO)"},
    ),
    "loss_type": (
        "TRL",
        "train.loss ('ppo' or 'cispo') and train.aggregation",
        {
            "grpo": _SEQ_MEAN,
            "bnpo": _TOKEN_MEAN,
            "dapo": _TOKEN_MEAN,
            "dr_grpo": "train.aggregation = 'seq_mean_token_sum_norm' (and advantage.estimator = 'drgrpo' for "
            "Dr. GRPO's advantage without the std)",
            "cispo": "train.loss = 'cispo'",
        },
    ),
    "vllm_importance_sampling_mode": (
        "TRL",
        "train.tis_mode",
        {
            "token_truncate": "train.tis_mode = 'truncate'",
            "token_mask": "train.tis_mode = 'mask'",
            "sequence_mask": "train.tis_mode = 'sequence_mask'",
        },
    ),
    "vllm_importance_sampling_correction": ("TRL", "train.tis_cap (> 0 turns the correction on)", {}),
    "vllm_importance_sampling_cap": ("TRL", "train.tis_cap", {}),
    "vllm_importance_sampling_clip_max": ("TRL", "train.tis_cap", {}),
    "vllm_importance_sampling_clip_min": ("TRL", "train.tis_low", {}),
    "beta": ("TRL", "train.kl_loss_coef (DPOConfig's beta: train.dpo_beta)", {}),
    "epsilon": ("TRL", "train.eps_low", {}),
    "epsilon_high": ("TRL", "train.eps_high (train.cispo_max with train.loss = 'cispo')", {}),
    "num_iterations": ("TRL", "train.ppo_epochs", {}),
    "learning_rate": ("TRL", "train.lr", {}),
    "max_completion_length": ("TRL", "generate.max_new_tokens", {}),
    "multi_objective_aggregation": (
        "TRL",
        "advantage.reward_normalization",
        {
            "sum_then_normalize": "advantage.reward_normalization = 'sum'",
            "normalize_then_sum": "advantage.reward_normalization = 'per_part' (with advantage.scale = 'batch')",
        },
    ),
    "scale_rewards": (
        "TRL",
        "advantage.scale",
        {
            True: "advantage.scale = 'group'",
            False: "advantage.scale = 'none'",
            "group": "advantage.scale = 'group'",
            "batch": "advantage.scale = 'batch'",
            "none": "advantage.scale = 'none'",
        },
    ),
    "mask_truncated_completions": ("TRL", "advantage.truncated", {True: "advantage.truncated = 'drop'"}),
    "clip_ratio_low": ("verl", "train.eps_low", {}),
    "clip_ratio_high": ("verl", "train.eps_high", {}),
    "clip_ratio": ("verl", "train.eps_low", {}),
    "clip_ratio_c": ("verl", "train.dual_clip", {}),
    "loss_mode": (
        "verl",
        "train.ratio_level and train.loss",
        {
            "vanilla": "train.ratio_level = 'token' with train.loss = 'ppo' (the defaults)",
            "gspo": "train.ratio_level = 'sequence' (GSPO)",
            "cispo": "train.loss = 'cispo'",
        },
    ),
    "loss_agg_mode": (
        "verl",
        "train.aggregation",
        {
            "token-mean": _TOKEN_MEAN,
            "seq-mean-token-mean": _SEQ_MEAN,
            "seq-mean-token-sum-norm": "train.aggregation = 'seq_mean_token_sum_norm'",
        },
    ),
    "entropy_coeff": ("verl", "train.entropy_coef", {}),
    "use_kl_loss": ("verl", "train.kl_loss_coef (> 0 turns it on)", {}),
    "adv_estimator": ("verl", "advantage.estimator", {}),
}


def foreign_hint(key: str, value: Any) -> str | None:
    """Our setting for a TRL or verl key (FOREIGN), None for any other name."""
    if key not in FOREIGN:
        return None
    source, ours, values = FOREIGN[key]
    try:
        exact = values.get(value)
    except TypeError:  # a list or table: no exact match
        exact = None
    if exact:
        return f"{source}'s {key} = {value!r} is {exact} here"
    known = ", ".join(repr(v) for v in values)
    return f"{source}'s {key} is {ours} here" + (f" (its values {known} have ours)" if known else "")


PATH_KEYS = (
    "run_dir",
    "policy_model",
    "ref_model",
    "reward_model",
    "score.teacher_model",
    "score.judge_model",
    "generate.prompts",
    "eval.prompts",
    "lora.init_adapter",
    "generate.python",
)


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, resolve_models: bool = True
) -> Config:
    """Read a TOML config (or the defaults when `path` is None) and apply `key=value` overrides.
    Models given as hub ids become their Hugging Face cache directories (`resolve_models`)."""
    raw: dict[str, Any] = {}
    base = Path.cwd()
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a text file (not UTF-8); a config is TOML text") from None
        base = p.resolve().parent
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = _build(Config, raw, where, "")
    if not cfg.run_dir.strip():  # "" would write iter=0000 into the current directory
        _fail(f"{where}: 'run_dir' must not be empty")
        cfg.run_dir = "runs/default"
    if cfg.threads == 0:
        cfg.threads = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
    _resolve_paths(cfg, base)
    _check_run_dir(cfg.run_dir, where)
    if resolve_models:
        _resolve_hub_ids(cfg)
    for d in [d for d in cfg.score.reward_paths if "://" in d]:
        _fail(
            f"{where}: 'score.reward_paths' {d}: reward modules are imported from local folders, not a "
            "store URI; install them as a package or give every machine a local copy"
        )
    cfg.score.reward_paths = [
        str(base / Path(d).expanduser()) for d in cfg.score.reward_paths if "://" not in d
    ]
    cfg.__dict__["source_dir"] = str(base)  # not a field: where the file is changes no result
    found = _PROBLEMS.get()
    start = len(found) if found is not None else 0
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if found is not None:
        found[start:] = [f"{where}: {m}" for m in found[start:]]
    return cfg


def _check_run_dir(run_dir: str, where: str) -> None:
    """A local run_dir must be able to become a folder: no name over 255 bytes, no file on its way."""
    if "://" in run_dir:
        return
    path = Path(run_dir)
    if long := [n for n in path.parts if len(os.fsencode(n)) > 255]:
        _fail(f"{where}: 'run_dir' has a name of {len(os.fsencode(long[0]))} bytes; at most 255 per folder")
        return
    for p in (path, *path.parents):
        try:
            if p.exists() and not p.is_dir():
                _fail(f"{where}: 'run_dir' {run_dir}: {p} is a file, not a folder")
                return
        except OSError:  # a folder this user cannot look into: the command names it when it gets there
            return


def check_groups(cfg: Config) -> None:
    """Group advantages need groups: one response per prompt has zero variance, every advantage 0."""
    if cfg.generate.num_generations < 2:
        raise ConfigError(
            f"'generate.num_generations' is {cfg.generate.num_generations}: a group of one response has "
            "zero variance, so every advantage is 0 and train learns nothing; set it >= 2"
        )


def check_config(
    path: str | Path | None, overrides: list[str] | None = None
) -> tuple[Config | None, list[str]]:
    """load_config that records every problem instead of stopping at the first (keys left at
    their defaults): the config (None when it cannot be read at all) and the problems."""
    token = _PROBLEMS.set([])
    try:
        try:
            cfg: Config | None = load_config(path, overrides)
        except UserError as e:  # one that stops the loading: no file, not TOML, a model not found
            cfg = None
            _PROBLEMS.get().append(str(e))  # type: ignore[union-attr]
        return cfg, list(_PROBLEMS.get() or [])
    finally:
        _PROBLEMS.reset(token)


def reward_search_path(cfg: Config) -> list[str]:
    """Where reward modules are imported from: `score.reward_paths` when set, else the config
    file's directory and the current directory (the same in `run`, a stage command and
    `--in-process`)."""
    if cfg.score.reward_paths:
        return list(cfg.score.reward_paths)
    return [cfg.__dict__.get("source_dir") or str(Path.cwd()), str(Path.cwd())]


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. generate.temperature=0.7")
    try:
        value: Any = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare string: --set run_dir=/tmp/run1
    key = key.strip()
    if key in PATH_KEYS:  # command-line paths are relative to the cwd
        value = (
            [_fix_item(lambda s, k: _absolute(k, s), v, key) for v in value]
            if isinstance(value, list)
            else _absolute(key, value)
        )
    *tables, last = key.split(".")
    node = raw
    for t in tables:
        node = node.setdefault(t, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {t} is not a table")
    node[last] = value


def _absolute(key: str, value: Any) -> Any:
    if not isinstance(value, str) or not value or "{run_dir}" in value or "://" in value or _hub(key, value):
        return value  # a URI (s3://, gs://, file://) is taken as it is
    return str(Path(value).expanduser().absolute())


def _build(cls: type, raw: dict[str, Any], where: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if f"{prefix}{key}" in RENAMED:
            _fail(f"{where}: '{prefix}{key}' was renamed to '{RENAMED[prefix + key]}'")
        elif key not in names and (foreign := foreign_hint(key, raw[key])) is not None:
            _fail(f"{where}: unknown key '{prefix}{key}': {foreign}")
        elif key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            _fail(f"{where}: unknown key '{prefix}{key}'{hint}")
    kwargs = {}
    for key, value in raw.items():
        typ = hints.get(key) if key in names else None
        if typ is None:
            continue  # recorded above
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                _fail(f"{where}: '{prefix}{key}' must be a table [{key}]")
                continue
            kwargs[key] = _build(typ, value, where, f"{prefix}{key}.")  # type: ignore[arg-type]
        else:
            try:
                kwargs[key] = _coerce(value, typ, where, f"{prefix}{key}")
            except ConfigError as e:
                _fail(str(e))
    return cls(**kwargs)


def _coerce(value: Any, typ: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is Literal:
        if value not in typing.get_args(typ):
            allowed = ", ".join(repr(a) for a in typing.get_args(typ))
            raise ConfigError(f"{where}: '{key}' must be one of {allowed}, got {value!r}")
        return value
    if origin is dict:  # a table of a list (generate.prompts' sources): its keys are checked by validate
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' must be a table, got {value!r}")
        return dict(value)
    if origin is list:
        (inner,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: '{key}' must be a list, got {value!r}")
        return [_coerce(v, inner, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):  # str | list[str]: the first that fits
        for arm in typing.get_args(typ):
            try:
                return _coerce(value, arm, where, key)
            except ConfigError:
                pass
        arms = [a for a in typing.get_args(typ) if a is not type(None)]  # None: unset, not written
        names = " or ".join(getattr(a, "__name__", str(a)) for a in arms)
        raise ConfigError(f"{where}: '{key}' must be {names}, got {value!r}")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: '{key}' must be a finite number, got {value!r}")
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: '{key}' must be {typ.__name__}, got {value!r}")
    return value


MODEL_KEYS = ("policy_model", "ref_model", "reward_model", "score.teacher_model", "score.judge_model")


def _key_node(cfg: Config, key: str) -> tuple[Any, str]:
    """(the object holding dotted `key`, its last name): `score.teacher_model` -> (cfg.score, ...)."""
    *tables, last = key.split(".")
    return (getattr(cfg, tables[0]) if tables else cfg), last


PROMPT_KEYS = ("generate.prompts", "eval.prompts")


def _hub(key: str, value: str, base: Path | None = None) -> bool:
    """A model or dataset hub id, not a local path (relative to `base`, else the cwd)."""
    if key in PROMPT_KEYS:
        from rlhf_batch.runtime.hub import is_hub_dataset

        return is_hub_dataset(value, base)
    from rlhf_batch.runtime.hub import is_hub_id

    return (
        key in MODEL_KEYS
        and is_hub_id(value)
        and not ((base or Path.cwd()) / value.partition("/")[0]).is_dir()
    )


def _resolve_hub_ids(cfg: Config) -> None:
    """Hub ids (`org/name[@revision]`) of models -> their snapshot directories in the HF cache."""
    from rlhf_batch.runtime.hub import resolve_hub_model

    for key in MODEL_KEYS:
        node, last = _key_node(cfg, key)
        value = getattr(node, last)
        if value and not Path(value).is_absolute() and _hub(key, value):
            try:
                setattr(node, last, resolve_hub_model(value, key))
            except UserError as e:  # a model not in the cache: recorded while checking
                if (found := _PROBLEMS.get()) is None:
                    raise
                found.append(str(e))


def _fix_item(fix: Any, v: Any, key: str) -> Any:
    """One item of a list of paths; a mixture's source table has its `path` fixed."""
    if isinstance(v, dict):
        return {**v, "path": fix(v["path"], key)} if isinstance(v.get("path"), str) else v
    return fix(v, key)


def _resolve_paths(cfg: Config, base: Path) -> None:
    hub_ids = {v for k in MODEL_KEYS if _hub(k, v := getattr(*_key_node(cfg, k)), base)}

    def fix(s: str, key: str = "") -> str:
        if not s or (s in hub_ids and not (base / s).exists()) or (key in PROMPT_KEYS and _hub(key, s, base)):
            return s
        s = s.replace("{run_dir}", cfg.run_dir)
        if "://" in s:  # a URI (s3://, gs://, file://) is taken as it is (store/fs.py)
            return s
        p = Path(s).expanduser()
        return str(p if p.is_absolute() else (base / p))

    cfg.run_dir = fix(cfg.run_dir)
    for key in PATH_KEYS[1:]:
        *tables, last = key.split(".")
        node = getattr(cfg, tables[0]) if tables else cfg
        value = getattr(node, last)
        setattr(
            node,
            last,
            [_fix_item(fix, v, key) for v in value] if isinstance(value, list) else fix(value, key),
        )
