"""Which run a read command (`status`, `sql`, `report`) looks at (`validate`'s checks: checks.py).

A read command takes the config file (positionally or with ``--config``) or the run directory
(positionally or with ``--run-dir``); without either, the current directory. The directory must
hold a run (an ``iter=*`` folder): anything else is an error naming it, so a cron job pointed
at the wrong place fails instead of printing an empty status.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_batch.errors import UserError
from rlhf_batch.observe.query import existing_run
from rlhf_batch.store.fs import run_path


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
    root = existing_run(root, where)
    if not any(p.is_dir() and p.name.startswith("iter=") for p in root.iterdir()):
        raise UserError(
            f"{root}: holds no run (no iter=* folder){where}; give the config file or the run directory"
        )
    return root


def iteration_range(spec: str) -> range:
    """`--iter` of `audit`: K, or A:B for the iterations A, A + 1, ..., B - 1 (as Python slices)."""
    first, sep, end = spec.partition(":")
    try:
        a = int(first)
        b = int(end) if sep else a + 1
    except ValueError:
        raise UserError(f"--iter: give K or A:B (iterations A..B-1), got {spec!r}") from None
    if a < 0 or b <= a:
        raise UserError(f"--iter {spec}: need 0 <= A < B (A:B is the iterations A..B-1)")
    return range(a, b)
