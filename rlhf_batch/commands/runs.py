"""Which run a read command (`status`, `sql`, `report`) looks at, and `validate`'s checks.

A read command takes the config file (positionally or with ``--config``) or the run directory
(positionally or with ``--run-dir``); without either, the current directory. The directory must
hold a run (an ``iter=*`` folder): anything else is an error naming it, so a cron job pointed
at the wrong place fails instead of printing an empty status.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_batch.errors import ConfigError, UserError
from rlhf_batch.store.fs import is_remote, run_path


def run_dir_of(target: str | None = None, run_dir: str | None = None, config: Path | None = None) -> Path:
    """The run directory named by a config file or a directory; UserError when it holds no run."""
    given = [x for x in (target, run_dir, config) if x is not None]
    if len(given) > 1:
        raise UserError("give one of CONFIG, RUN_DIR, --config or --run-dir, not several")
    if target is not None and "://" not in target and (target.endswith(".toml") or Path(target).is_file()):
        config = Path(target)
    elif target is not None:
        run_dir = target
    where = ""
    if config is not None:
        from rlhf_batch.config import load_config

        root = run_path(load_config(config, resolve_models=False).run_dir)
        where = f" (run_dir of {config})"
    else:
        root = run_path(run_dir) if run_dir is not None else Path(".")
    root = root if is_remote(root) else root.expanduser().resolve()
    if not root.is_dir():
        raise UserError(f"{root}: run directory not found{where}")
    if not any(p.is_dir() and p.name.startswith("iter=") for p in root.iterdir()):
        raise UserError(
            f"{root}: holds no run (no iter=* folder){where}; give the config file or the run directory"
        )
    return root


def validate(cfg: Any) -> list[str]:
    """Check what a run needs before it starts: model directories (or cached hub ids) with a
    config transformers can load, the prompt file and the columns the config names, the reward
    functions' imports. Returns what was checked; the first problem is a one-line error."""
    from rlhf_batch.config import reward_search_path
    from rlhf_batch.rewards import load_reward_functions

    checked: list[str] = []
    models = [
        ("policy_model", cfg.policy_model),
        ("ref_model", cfg.ref_model),
        ("reward_model", cfg.reward_model),
    ]
    for what, path in models:
        if what == "policy_model" and cfg.demo and not Path(path).exists():
            continue  # the demo builds it
        if what == "policy_model" or path:
            _check_model(path, what)
            checked.append(f"{what} {path}")
    if not (cfg.demo and not Path(cfg.generate.prompts).exists()):
        checked.append(_check_prompts(cfg))
    for d in cfg.score.reward_paths:
        if not Path(d).is_dir():
            raise ConfigError(f"score.reward_paths: {d}: directory not found")
    fns = load_reward_functions(
        cfg.score.reward_functions, cfg.score.reward_weights, (), reward_search_path(cfg)
    )
    checked += [f"reward function {rf.path}" for rf in fns]
    return checked


def _check_model(path: str, what: str) -> None:
    from rlhf_batch.errors import ModelError
    from rlhf_batch.store.modeldir import check_model_dir

    p = check_model_dir(path, what)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{what}: {p}/config.json does not load ({str(e).splitlines()[0]})") from None


def _check_prompts(cfg: Any) -> str:
    from rlhf_batch.data.prompts import chat_column, no_prompt_column, read_table
    from rlhf_batch.errors import StageError

    g = cfg.generate
    table = read_table(g.prompts)
    if table.num_rows == 0:
        raise StageError(f"{g.prompts}: the prompt file is empty")
    column = chat_column(table, g) or (g.prompt_column if g.prompt_column in table.column_names else "")
    if not column:
        raise no_prompt_column(table, g, g.prompts)
    return f"prompts {g.prompts} ({table.num_rows} rows, column '{column}')"
