"""`validate`: what a run needs, checked before it starts, every problem reported in one run.

Checked: the config's keys, types and values (config.check_config); the model directories, local
or on a store (or cached hub ids), with a config transformers can load; the prompt files of `generate.prompts` and
`eval.prompts` (readable, not empty, a prompt column, the id column and its ids: prompt_ids.py);
the reward functions (imports, column names that do not clash, each function's arguments
against the columns of the prompts it scores: rewards.conventions.argument_problem); LoRA's
`init_adapter` and `target_modules` against the policy's modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_batch.config import check_groups
from rlhf_batch.errors import ConfigError, ModelError, UserError


def validate(cfg: Any) -> tuple[list[str], list[str]]:
    """(what was checked and is fine, the problems found): every check runs, whatever fails."""
    ok: list[str] = []
    problems: list[str] = []

    def check(fn: Callable[[], Any]) -> Any:
        try:
            done = fn()
        except UserError as e:
            problems.extend(getattr(e, "problems", [str(e)]))
            return None
        if isinstance(done, bool):  # a question, not a check
            return done
        ok.extend([done] if isinstance(done, str) else done or [])
        return done

    for what in ("policy_model", "ref_model", "reward_model", "score.teacher_model"):
        path = cfg.score.teacher_model if what == "score.teacher_model" else getattr(cfg, what)
        if what == "policy_model" and cfg.demo and not check(functools.partial(_exists, path, what)):
            continue  # the demo builds it
        if what == "policy_model" or path:
            check(functools.partial(_check_model, path, what))
    columns: dict[str, list[str] | None] = {"generate": None, "eval": None}
    prompts = cfg.generate.prompts
    if not (
        cfg.demo and isinstance(prompts, str) and not check(lambda: _exists(prompts, "generate.prompts"))
    ):
        check(lambda: _check_prompts(cfg.generate, "generate.prompts", columns, "generate"))
    if cfg.eval.prompts:
        check(lambda: _check_prompts(_eval_sampling(cfg), "eval.prompts", columns, "eval"))
    for d in cfg.score.reward_paths:
        if not Path(d).is_dir():
            problems.append(f"score.reward_paths: {d}: directory not found")
    if cfg.generate.environment:
        check(lambda: _check_environment(cfg))
    check(lambda: _check_rewards(cfg, "score", columns["generate"]))
    if cfg.eval.prompts:  # eval's functions (default: score's) against the eval prompts' columns
        check(lambda: _check_rewards(cfg, "eval", columns["eval"]))
    if cfg.score.audit_functions:  # against the generate prompts' columns, as score's
        check(lambda: _check_audits(cfg, columns["generate"]))
    if cfg.lora.enabled:
        check(lambda: _check_lora(cfg))
    check(lambda: check_groups(cfg))
    check(lambda: _check_devices(cfg))
    return ok, list(dict.fromkeys(problems))  # eval's functions may be score's: each problem once


def _check_devices(cfg: Any) -> str | None:
    """The CUDA devices `device`, generate.device and train.device name exist on this machine."""
    wanted = {"device": cfg.device, "generate.device": cfg.generate.device, "train.device": cfg.train.device}
    wanted = {k: v for k, v in wanted.items() if v.startswith("cuda")}
    if not wanted:
        return None
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problems = []
    for key, value in wanted.items():
        ids = [int(i) for i in value.removeprefix("cuda").lstrip(":").split(",") if i] or [0]
        if max(ids) >= have:
            problems.append(f"{key}: {value!r} needs CUDA GPU {max(ids)}; this machine has {have}")
    if problems:
        err = ConfigError(problems[0])
        err.problems = problems  # type: ignore[attr-defined]
        raise err
    return ", ".join(f"{k} {v}" for k, v in wanted.items())


def _exists(path: str, what: str) -> bool:
    """Whether a local path or store URI exists (a missing store package: one line naming `what`);
    an empty one counts as there, for its check to say it is not configured."""
    from rlhf_batch.store.fs import run_path

    return not path or run_path(path, what).exists()


def _check_model(path: str, what: str) -> str:
    from transformers import AutoConfig

    from rlhf_batch.store.modeldir import check_model_dir, config_dir

    p = check_model_dir(path, what)
    try:
        with config_dir(p) as local:
            AutoConfig.from_pretrained(local, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{what}: {p}/config.json does not load ({str(e).splitlines()[0]})") from None
    return f"{what} {path}"


def _eval_sampling(cfg: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cfg.generate, prompts=cfg.eval.prompts)


def _check_prompts(g: Any, key: str, columns: dict[str, list[str] | None], stage: str) -> str:
    """The prompt file `g.prompts`: readable, not empty, a prompt column, good ids. Records the
    columns reward functions will see in `columns[stage]`."""
    from rlhf_batch.data.prompt_files import describe
    from rlhf_batch.data.prompt_ids import given_ids, repeat_numbers
    from rlhf_batch.data.prompts import carried_table, prompt_set_problems, prompt_values

    where = describe(g.prompts)
    table, problems = prompt_set_problems(g, key)  # what generate checks, every problem listed
    if problems:
        raise _Many(problems)
    assert table is not None
    values = prompt_values(table, g, where)
    ids = given_ids(table, g.id_column, where)
    columns[stage] = carried_table(table, g).column_names
    if ids is not None:
        how = f"ids from '{g.id_column}'"
    else:
        repeats = sum(1 for r in repeat_numbers(values) if r)
        how = "ids hashed from the prompts" + (
            f", {repeats} repeated prompts (each its own prompt)" if repeats else ""
        )
    return f"{key} {where} ({table.num_rows} rows, {how})"


def _check_rewards(cfg: Any, stage: str, columns: list[str] | None) -> list[str]:
    """Every function imports, no two write one column, each one's arguments have columns."""
    from rlhf_batch.config import reward_search_path
    from rlhf_batch.rewards import load_reward_functions
    from rlhf_batch.rewards.conventions import argument_problem

    table = cfg.eval if stage == "eval" and cfg.eval.reward_functions else cfg.score
    problems, fns = [], []
    for path in table.reward_functions:
        try:
            fns += load_reward_functions([path], (), (), reward_search_path(cfg))
        except UserError as e:
            problems.append(str(e))
    if not problems:
        load_reward_functions(table.reward_functions, table.reward_weights, (), reward_search_path(cfg))
    for rf in fns:
        cols = columns if columns is None or stage == "eval" else [*columns, *_env_parts(cfg, rf)]
        if cols is not None and (problem := argument_problem(rf, cols)):
            problems.append(f"{stage}.reward_functions: {problem}")
    if problems:
        raise _Many(problems)
    return [f"{stage} reward function {rf.path}" for rf in fns]


def _check_environment(cfg: Any) -> str:
    """generate.environment imports (a bad name: one line) and what reward parts it declares."""
    from rlhf_batch.stages.multiturn import environment_factory

    parts = getattr(environment_factory(cfg, cfg.generate.environment), "reward_parts", None)
    said = f"reward parts {', '.join(parts)}" if parts is not None else "reward parts not declared"
    return f"generate.environment {cfg.generate.environment} ({said})"


def _env_parts(cfg: Any, rf: Any) -> list[str]:
    """With generate.environment, the columns env_<name> of the reward parts its factory
    declares (`factory.reward_parts`, docs/multi-turn.md), which only generate makes; a factory
    that declares none: every env_<name> argument of the function (not checked)."""
    import inspect

    from rlhf_batch.stages.multiturn import environment_factory

    if not cfg.generate.environment:
        return []
    try:
        parts = getattr(environment_factory(cfg, cfg.generate.environment), "reward_parts", None)
    except UserError:  # _check_environment says so
        parts = None
    if parts is not None:
        return [f"env_{p}" for p in parts]
    try:
        return [n for n in inspect.signature(rf.fn).parameters if n.startswith("env_")]
    except (TypeError, ValueError):
        return []


def _check_audits(cfg: Any, columns: list[str] | None) -> list[str]:
    """score.audit_functions: every one imports, their columns differ, their arguments have columns."""
    from rlhf_batch.config import reward_search_path
    from rlhf_batch.rewards import load_reward_functions
    from rlhf_batch.rewards.conventions import argument_problem

    key = "score.audit_functions"
    fns = load_reward_functions(cfg.score.audit_functions, (), (), reward_search_path(cfg), key)
    problems = [f"{key}: {p}" for rf in fns if columns is not None and (p := argument_problem(rf, columns))]
    if problems:
        raise _Many(problems)
    return [f"audit function {rf.path}" for rf in fns]


class _Many(ConfigError):
    """Several problems of one check (one line each)."""

    def __init__(self, problems: list[str]):
        super().__init__(problems[0])
        self.problems = problems


def _check_lora(cfg: Any) -> str:
    from rlhf_batch.store.layout import ADAPTER_WEIGHTS

    lc = cfg.lora
    if lc.init_adapter and not (Path(lc.init_adapter) / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(
            f"lora.init_adapter: {lc.init_adapter} has no {ADAPTER_WEIGHTS} (a peft LoRA adapter dir)"
        )
    if lc.target_modules != ["all-linear"]:
        from rlhf_batch.store.fs import run_path
        from rlhf_batch.store.modeldir import config_dir

        with config_dir(run_path(cfg.policy_model, "policy_model")) as local:
            names = _module_names(str(local), cfg.trust_remote_code)
        if unknown := [t for t in lc.target_modules if t not in names]:
            raise ConfigError(
                f"lora.target_modules: {', '.join(map(repr, unknown))} not in {cfg.policy_model} "
                f"(its modules: {', '.join(sorted(names))})"
            )
    return f"lora r={lc.r} on {', '.join(lc.target_modules)}"


def _module_names(path: str, trust_remote_code: bool) -> set[str]:
    """The last name of every module of the model, built on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {name.rpartition(".")[2] for name, _ in model.named_modules() if name}
