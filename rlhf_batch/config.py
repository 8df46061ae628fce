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

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlhf_batch.errors import ConfigError


@dataclass
class GenerateConfig:
    prompts: str = ""  # HF datasets dir (save_to_disk), .jsonl or .parquet
    prompt_column: str = "prompt"  # plain-text prompts
    messages_column: str = "messages"  # chat prompts: list of {role, content}
    id_column: str = "id"  # used as prompt_id when present, else a hash of the prompt
    max_prompt_tokens: int = 1024
    overlong: Literal["error", "truncate_left", "skip"] = "error"
    num_generations: int = 8  # G samples per prompt
    prompts_per_iteration: int = 0  # B prompts per iteration from a per-epoch shuffle; 0: all, in file order
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    batch_size: int = 64  # rows (prompt x sample) decoded together
    prompts_per_part: int = 256  # resume granularity: one Parquet part per this many prompts


@dataclass
class ScoreConfig:
    reward_functions: list[str] = field(default_factory=list)  # "package.module:function"
    reward_weights: list[float] = field(default_factory=list)  # default: 1.0 each
    reward_model_weight: float = 1.0
    score_clip: float = 0.0  # clip the score to [-c, c]; 0 disables
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_in_reward: bool = True  # reward = score - kl_coef * kl_sum
    kl_controller: Literal["constant", "adaptive"] = "constant"
    kl_coef: float = 0.05  # beta (initial beta for the adaptive controller)
    kl_target: float = 6.0  # adaptive controller: target KL per sequence
    kl_horizon: int = 10000  # adaptive controller: horizon in rollouts
    max_tokens_per_batch: int = 16384  # token budget of a forward batch
    rows_per_part: int = 2048


@dataclass
class AdvantageConfig:
    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"  # (r-mean)/(std+eps) | r-mean | leave-one-out
    scale: Literal["group", "batch", "none"] = "group"  # grpo's std: of the group, of the batch, none
    ddof: int = 1  # std: 1 sample (stddev_samp, as TorchRL's MCAdvantage), 0 population
    eps: float = 1e-6  # added to the std (TorchRL's MCAdvantage default)
    window: int = 1  # pool groups over the last W iterations
    drop_zero_variance: bool = True  # drop groups whose rewards are all equal (DAPO dynamic sampling)
    min_group_size: int = 2  # drop groups with fewer scored rollouts
    truncated: Literal["keep", "drop", "zero"] = "keep"  # finish_reason = 'length'
    bucket_tokens: int = 64  # width of a length bucket
    rows_per_shard: int = 4096


@dataclass
class TrainConfig:
    ppo_epochs: int = 1
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    max_grad_norm: float = 1.0
    tokens_per_step: int = 65536  # real tokens per optimizer step (global)
    max_tokens_per_batch: int = 16384  # token budget of one micro-batch
    max_padding: float = 0.1  # close a micro-batch before padding exceeds this share of its tokens
    eps_low: float = 0.2
    eps_high: float = 0.0  # 0: same as eps_low
    dual_clip: float = 0.0  # 0: off; else c > 1
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    norm_const: float = 0.0  # seq_mean_token_sum_norm divisor; 0: generate.max_new_tokens
    kl_coef: float = 0.0  # k3 KL to the reference in the loss
    kl_to_inference_coef: float = 0.0
    entropy_coef: float = 0.0
    recompute_old: bool = False
    gradient_checkpointing: bool = False
    autocast_bf16: bool = True  # bf16 autocast when dtype resolves to bfloat16; master weights float32
    checkpoint_every: int = 0  # optimizer steps; 0: only at the end
    fsdp: bool = False  # under torchrun: shard weights, gradients and AdamW state (FSDP2); 1 process: no-op


@dataclass
class Config:
    run_dir: str = "runs/default"
    seed: int = 0
    iterations: int = 1
    epochs: int = 0  # > 0: size the run in passes over the prompt set instead (overrides iterations)
    policy_model: str = ""  # initial policy (iteration 0)
    ref_model: str = ""  # default: the initial policy
    reward_model: str = ""  # optional sequence-classification model (1 label)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    threads: int = 0  # CPU threads for torch; 0: torch's default (small models run best on 1)
    in_process: bool = False  # run: stages in this process instead of one subprocess each
    demo: bool = False  # generate: build the tiny demo model and prompts when missing
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def ref(self) -> str:
        return self.ref_model or self.policy_model

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def stage_dict(self, stage: str) -> dict[str, Any]:
        """The run-level keys that can change a result plus one stage's table."""
        top = {k: v for k, v in self.to_dict().items() if not isinstance(v, dict) and k not in NOT_IDENTITY}
        return {**top, stage: dataclasses.asdict(getattr(self, stage))}


# run-level keys that change no stage's result
NOT_IDENTITY = ("iterations", "epochs", "in_process", "demo", "threads")
PATH_KEYS = ("run_dir", "policy_model", "ref_model", "reward_model", "generate.prompts")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML config (or the defaults when `path` is None) and apply `key=value` overrides."""
    raw: dict[str, Any] = {}
    base = Path.cwd()
    where = "config"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        base = p.resolve().parent
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = _build(Config, raw, where, "")
    _resolve_paths(cfg, base)
    _check(cfg, where)
    return cfg


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. generate.temperature=0.7")
    try:
        value: Any = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare string: --set run_dir=/tmp/run1
    key = key.strip()
    if key in PATH_KEYS and isinstance(value, str) and value and "{run_dir}" not in value:
        value = str(Path(value).expanduser().absolute())  # command-line paths are relative to the cwd
    *tables, last = key.split(".")
    node = raw
    for t in tables:
        node = node.setdefault(t, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {t} is not a table")
    node[last] = value


def _build(cls: type, raw: dict[str, Any], where: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key '{prefix}{key}'{hint}")
    kwargs = {}
    for key, value in raw.items():
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{prefix}{key}' must be a table [{key}]")
            kwargs[key] = _build(typ, value, where, f"{prefix}{key}.")  # type: ignore[arg-type]
        else:
            kwargs[key] = _coerce(value, typ, where, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(value: Any, typ: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is Literal:
        if value not in typing.get_args(typ):
            allowed = ", ".join(repr(a) for a in typing.get_args(typ))
            raise ConfigError(f"{where}: '{key}' must be one of {allowed}, got {value!r}")
        return value
    if origin is list:
        (inner,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: '{key}' must be a list, got {value!r}")
        return [_coerce(v, inner, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{where}: '{key}' has an unsupported type")  # not used by Config
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: '{key}' must be {typ.__name__}, got {value!r}")
    return value


def _resolve_paths(cfg: Config, base: Path) -> None:
    def fix(s: str) -> str:
        if not s:
            return s
        s = s.replace("{run_dir}", cfg.run_dir)
        p = Path(s).expanduser()
        return str(p if p.is_absolute() else (base / p))

    cfg.run_dir = fix(cfg.run_dir)
    for key in PATH_KEYS[1:]:
        *tables, last = key.split(".")
        node = cfg.generate if tables else cfg
        setattr(node, last, fix(getattr(node, last)))


def _check(cfg: Config, where: str) -> None:
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: '{key}' {what}")

    g, s, a, t = cfg.generate, cfg.score, cfg.advantage, cfg.train
    need(cfg.iterations >= 1, "iterations", "must be >= 1")
    need(cfg.threads >= 0, "threads", "must be >= 0")
    need(cfg.epochs >= 0, "epochs", "must be >= 0 (0: the run is sized by iterations)")
    need(g.prompts_per_iteration >= 0, "generate.prompts_per_iteration", "must be >= 0 (0: every prompt)")
    need(g.num_generations >= 1, "generate.num_generations", "must be >= 1")
    need(g.max_new_tokens >= 1, "generate.max_new_tokens", "must be >= 1")
    need(g.temperature > 0, "generate.temperature", "must be > 0")
    need(0 < g.top_p <= 1, "generate.top_p", "must be in (0, 1]")
    need(g.top_k >= 0, "generate.top_k", "must be >= 0")
    need(g.batch_size >= 1, "generate.batch_size", "must be >= 1")
    need(g.prompts_per_part >= 1, "generate.prompts_per_part", "must be >= 1")
    need(g.max_prompt_tokens >= 1, "generate.max_prompt_tokens", "must be >= 1")
    need(
        not s.reward_weights or len(s.reward_weights) == len(s.reward_functions),
        "score.reward_weights",
        f"has {len(s.reward_weights)} weights for {len(s.reward_functions)} reward_functions",
    )
    need(s.score_clip >= 0, "score.score_clip", "must be >= 0")
    need(s.kl_coef >= 0, "score.kl_coef", "must be >= 0")
    need(s.kl_target > 0, "score.kl_target", "must be > 0")
    need(s.kl_horizon > 0, "score.kl_horizon", "must be > 0")
    need(s.max_tokens_per_batch >= 1, "score.max_tokens_per_batch", "must be >= 1")
    need(a.ddof in (0, 1), "advantage.ddof", "must be 0 or 1")
    need(a.eps >= 0, "advantage.eps", "must be >= 0")
    need(a.window >= 1, "advantage.window", "must be >= 1")
    need(a.min_group_size >= 1, "advantage.min_group_size", "must be >= 1")
    need(a.bucket_tokens >= 1, "advantage.bucket_tokens", "must be >= 1")
    need(a.rows_per_shard >= 1, "advantage.rows_per_shard", "must be >= 1")
    need(t.ppo_epochs >= 1, "train.ppo_epochs", "must be >= 1")
    need(t.lr >= 0, "train.lr", "must be >= 0")
    need(t.eps_low > 0, "train.eps_low", "must be > 0")
    need(t.dual_clip == 0 or t.dual_clip > 1, "train.dual_clip", "must be 0 (off) or > 1")
    need(t.tokens_per_step >= 1, "train.tokens_per_step", "must be >= 1")
    need(t.max_tokens_per_batch >= 1, "train.max_tokens_per_batch", "must be >= 1")
    need(0 < t.max_padding <= 1, "train.max_padding", "must be in (0, 1]")
