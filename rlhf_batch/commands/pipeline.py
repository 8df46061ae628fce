"""`run`: every stage of iterations 0..N-1, skipping what is complete, under a run-dir lock.

Each stage runs in its own process by default (`python -m rlhf_batch STAGE CONFIG --iter K`),
so stages may use different devices and a crash takes one stage down, not the run; with
`in_process = true` (or `--in-process`) they run in this process, which saves the start-up
time of the small demo. `generate.python` names another interpreter for the generate stage
(vLLM lives in its own venv) and for eval, which samples with generate's engine: they then run in
a child process even with `in_process`; the `generate` and `eval` commands started in another
interpreter hand themselves over to it (`in_generate_python`).
Either way the files are the only interface between stages, and a re-run after a crash does
only the missing work.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlhf_batch.config import Config, check_groups, load_config
from rlhf_batch.errors import StageError, UserError
from rlhf_batch.runtime.procgroup import die_with
from rlhf_batch.stages.executor import execute
from rlhf_batch.store import layout, manifests, redo, staging
from rlhf_batch.store.fs import run_path
from rlhf_batch.store.lock import LOCK_ENV, RunLock, lock_id


def run_pipeline(
    config_path: Path,
    overrides: list[str],
    quiet: bool = False,
    settle_heap: bool = False,
    redo_from: str | None = None,
) -> None:
    """The run. `settle_heap` (the `run` command, a process of its own): with `in_process`,
    this process's heap is settled after its first iteration (see `run_iteration`).
    `redo_from` ("K" or "K:STAGE", `run --redo-from`): that stage and every one downstream are
    redone (store/redo.py); a pending redo of an earlier `run` is finished either way."""
    from rlhf_batch.data.prompts import run_iterations

    cfg = load_config(config_path, overrides)
    with RunLock(run_path(cfg.run_dir)), _env(LOCK_ENV, lock_id(cfg.run_dir)):
        staging.recover(cfg.run_dir, drop_uncommitted=True)  # --force swaps a kill interrupted, leftovers
        if cfg.in_process and not cfg.max_staleness:  # overlapped: the lanes run the stages
            from rlhf_batch.runtime.device import setup_process

            setup_process(cfg.threads)
        if cfg.demo and cfg.epochs:
            from rlhf_batch.data.demo import ensure_demo_assets

            ensure_demo_assets(cfg)  # the prompt set sizes the run
        cfg.iterations = run_iterations(cfg)  # `epochs`, when set, sizes the run
        from rlhf_batch.models.lora import check_targets

        check_targets(cfg)  # before any stage: a misspelt module fails now, not at train
        check_groups(cfg)
        if cfg.max_staleness and (redo_from is not None or redo.read(cfg.run_dir)):
            raise UserError(
                "--redo-from: not with max_staleness > 0 (its two lanes would sample from a policy "
                "before it is redone); redo the stages with their commands and --force"
            )
        if redo_from is not None:
            _start_redo(cfg, redo_from, quiet)

        if cfg.max_staleness:  # overlapped: two lanes, each a process (lanes.py)
            from rlhf_batch.commands.lanes import run_overlapped

            run_overlapped(cfg, config_path, overrides, quiet)
        else:
            run_stage = _stage_runner(cfg, config_path, overrides, quiet)
            mark = redo.read(cfg.run_dir)
            with (
                _resident(cfg.in_process),  # the policy, reference and AdamW state stay in memory
                _env(redo.ENV, mark["token"]) if mark else contextlib.nullcontext(),
            ):
                for it in range(cfg.iterations + 1):  # + 1: a stage may run after the last (eval)
                    run_iteration(cfg, it, run_stage, quiet, settle_heap and cfg.in_process)
            if mark:
                redo.finish(cfg.run_dir)
    print_summary(cfg)


def _stage_runner(
    cfg: Config, config_path: Path, overrides: list[str], quiet: bool, in_process: tuple[str, ...] = ()
) -> Callable[[Any], None]:
    """run_stage(stage): nothing if it is complete, else it runs, in this process with
    `in_process` (only the stages named in `in_process`, when given), else in a child process
    (`python -m rlhf_batch STAGE CONFIG --iter K`)."""
    from rlhf_batch.stages.executor import is_done

    seen = {"done": 0, "ran": 0}  # complete stages before the first that runs: a resumed run
    mark = redo.read(cfg.run_dir)  # a pending `run --redo-from`

    def run_stage(stage: Any) -> None:
        force = redo.pending(mark, stage.iteration, stage.name, manifests.manifest(stage.sdir))
        if not force and is_done(stage):
            seen["done"] += 0 if seen["ran"] else 1
            return
        if seen["done"] and not seen["ran"]:
            _say(f"resuming {cfg.run_dir}: {seen['done']} stages already complete are skipped", quiet)
        seen["ran"] += 1
        rnd = f" (top-up round {stage.topup})" if stage.topup else ""
        again = f" (redo from {redo.label(mark)})" if force and mark else ""
        _say(f"iteration {stage.iteration}: {stage.name}{rnd}{again}", quiet)
        python = cfg.generate.python if samples(cfg, stage.name) else ""  # e.g. vLLM's own venv
        if cfg.in_process and not python and (not in_process or stage.name in in_process):
            execute(stage, quiet=quiet, force=force)
        else:
            _run_child(config_path, overrides, stage.name, stage.iteration, quiet, stage.topup, python, force)
        if stage.name == "generate" and cfg.generate.environment:
            _say(f"iteration {stage.iteration}: trajectories: {trajectory_line(stage)}", quiet)
        if stage.name == "train":
            warn_health(cfg, stage.iteration)
            warn_reward_health(cfg, stage.iteration)

    return run_stage


def _start_redo(cfg: Config, spec: str, quiet: bool) -> None:
    """`run --redo-from`: check the start point and write the mark (store/redo.py)."""
    from rlhf_batch.stages.registry import pipeline

    order = [s.name for s in pipeline()]
    it, name = redo.parse(spec, order)
    if it > cfg.iterations:
        raise UserError(f"--redo-from {spec}: the run has iterations 0..{cfg.iterations - 1}")
    stage = next(s for s in pipeline() if s.name == name)
    m = manifests.manifest(layout.folder(cfg.run_dir, it, stage.folder))
    if m is None:
        raise UserError(
            f"--redo-from {spec}: {layout.folder(cfg.run_dir, it, stage.folder)} is not complete; "
            "nothing to redo there (`run` without --redo-from runs it)"
        )
    mark = redo.start(cfg.run_dir, it, name, order)
    _say(f"redo from {redo.label(mark)}: that stage and every one after it run again", quiet)


def run_lane(lane: str, config_path: Path, overrides: list[str], quiet: bool) -> None:
    """The `lane` command: one lane of a `run` with max_staleness > 0 (lanes.py), which holds the
    run lock, iteration by iteration."""
    from rlhf_batch.commands.lanes import LANES, await_folder, await_policy, use_side, warm_up
    from rlhf_batch.runtime.device import setup_process
    from rlhf_batch.stages.registry import pipeline

    if lane not in LANES:
        raise UserError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
    cfg = load_config(config_path, overrides)
    if os.environ.get(LOCK_ENV) != lock_id(cfg.run_dir):
        raise UserError(
            f"`lane` runs under `rlhf-batch run` (which holds the lock of {cfg.run_dir}), not by hand"
        )
    use_side(cfg, LANES[lane][0])
    if cfg.in_process:
        setup_process(cfg.threads)
        warm_up(lane)
    global SAY_PREFIX
    SAY_PREFIX = f"[{lane}] "
    # stages of the other side (the learn lane's top-up rounds) run as processes with their side
    run_stage = _stage_runner(cfg, config_path, overrides, quiet, in_process=LANES[lane])
    with _resident(cfg.in_process):
        for it in range(cfg.iterations + 1):
            for stage_class in pipeline():
                if stage_class.name not in LANES[lane] or not stage_class.runs_at(cfg, it):
                    continue
                stage = stage_class(cfg, it)
                if stage.name == "generate":
                    await_policy(cfg, it)
                if stage.name == "advantage":
                    await_folder(cfg, it, layout.SCORES)
                    top_up(stage, run_stage, quiet)
                run_stage(stage)


def _resident(in_process: bool) -> contextlib.AbstractContextManager[None]:
    """With `in_process`: models and the optimizer state this process writes or reads stay in
    memory while the run goes on, and are copied from there instead of re-read while their files
    are unchanged (models/resident.py); the files are still written and stay the interface."""
    from rlhf_batch.models import resident

    return resident.keep() if in_process else contextlib.nullcontext()


def run_topup(config_path: Path, overrides: list[str], it: int, quiet: bool = False) -> None:
    """`topup`: the dynamic-sampling rounds of iteration `it` that `run` runs before its advantage
    stage (nothing when advantage.min_groups is 0 or the advantages are complete), for a
    scheduler that runs the stages as tasks of its own (the Airflow DAG)."""
    from rlhf_batch.stages.registry import get
    from rlhf_batch.store.lock import stage_lock

    if it < 0:
        raise UserError(f"--iter must be >= 0, got {it}")
    cfg = load_config(config_path, overrides)
    with stage_lock(cfg.run_dir), _env(LOCK_ENV, lock_id(cfg.run_dir)):
        if cfg.in_process:
            from rlhf_batch.commands.lanes import use_side
            from rlhf_batch.runtime.device import setup_process

            use_side(cfg, "generate")  # its rounds are generate and score
            setup_process(cfg.threads)
        top_up(get("advantage")(cfg, it), _stage_runner(cfg, config_path, overrides, quiet), quiet)


def run_iteration(
    cfg: Config, it: int, run_stage: Callable[[Any], None], quiet: bool = True, settle_heap: bool = False
) -> None:
    """The stages of iteration `it` in order, through `run_stage`; before advantage, the top-up
    rounds that `advantage.min_groups` asks for. `settle_heap` (a process that runs its stages
    itself): the first such iteration of the process defers Python's full garbage collections
    and ends with the heap frozen (below)."""
    from rlhf_batch.stages.registry import pipeline

    first = _defer_full_collections() if settle_heap else None
    try:
        for stage_class in pipeline():
            if not stage_class.runs_at(cfg, it):
                continue
            stage = stage_class(cfg, it)
            if stage.name == "advantage":
                top_up(stage, run_stage, quiet)
            run_stage(stage)
    finally:
        if first:
            _settle_heap(first)


# The heap of a process that runs stages. Its first iteration imports torch, transformers and
# DuckDB and loads the models: the heap grows from nothing to millions of objects, and Python
# runs a full collection each time the long-lived objects grow by a quarter, walking all of
# them again (7 full collections, 0.7 s, in the first 3.5 s of the demo, measured; none after).
# So during the first iteration full collections are 10x rarer (young cycles are still
# collected as usual); after it `gc.freeze()`: what the process holds by then (modules, model
# templates) is left out of later full collections. No full collection before the freeze: it
# would walk the ~400k objects once more (0.2 s) to find a few hundred dead ones, which stay
# frozen. Objects are freed by reference counting as before; only a reference cycle dead by
# then or later would stay (nothing of a stage is alive between iterations). At exit they are
# unfrozen, so that finalisation collects them as it did.
_HEAP: dict[str, Any] = {}  # pid: the process that deferred


def _defer_full_collections() -> tuple[int, int, int] | None:
    """On this process's first call: the thresholds to restore after the iteration; else None."""
    if _HEAP.get("pid") == os.getpid():
        return None
    _HEAP["pid"] = os.getpid()
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1], old[2] * 10)
    return old


def _settle_heap(thresholds: tuple[int, int, int]) -> None:
    gc.freeze()
    gc.set_threshold(*thresholds)
    atexit.register(gc.unfreeze)


def top_up(advantage: Any, run_stage: Callable[[Any], None], quiet: bool) -> None:
    """Dynamic sampling (topup.py), before the `advantage` stage of an iteration that is not
    complete: top-up rounds of generate + score while the iteration has fewer informative groups
    than advantage.min_groups, up to advantage.max_topup_rounds. A round already complete was
    decided before, so a re-run after a kill makes the same decisions."""
    from rlhf_batch.stages.advantage import informative_groups, topup_rounds
    from rlhf_batch.stages.executor import is_done
    from rlhf_batch.stages.registry import get

    cfg, it, a = advantage.cfg, advantage.iteration, advantage.cfg.advantage
    redoing = redo.pending(redo.read(cfg.run_dir), it, advantage.name, manifests.manifest(advantage.sdir))
    if not a.min_groups or (is_done(advantage) and not redoing):
        return
    for r in range(1, a.max_topup_rounds + 1):
        if r not in topup_rounds(cfg, it):
            have = informative_groups(cfg, it)
            if have >= a.min_groups:
                return
            _say(f"iteration {it}: {have} informative groups < advantage.min_groups={a.min_groups}", quiet)
        for name in ("generate", "score"):
            run_stage(get(name)(cfg, it, r))


SAMPLING = ("generate", "eval")  # the stages that sample with generate's engine (generate.python)


def samples(cfg: Any, stage: str) -> bool:
    """Whether `stage` runs generate's engine, so in `generate.python`: generate, eval, and score
    with an LLM judge (score.judge_model)."""
    return stage in SAMPLING or (stage == "score" and bool(cfg.score.judge_model))


PYTHON_ENV = "RLHF_BATCH_PYTHON"  # the generate.python a stage process was started in


def stage_command(
    python: str, stage: str, config_path: Path, it: int, overrides: list[str], quiet: bool, *extra: str
) -> list[str]:
    """`python -P -m rlhf_batch STAGE CONFIG --iter K [EXTRA] [--set O ...] [--quiet]`; -P: the
    current directory is not put on sys.path, so no file there shadows a module."""
    cmd = [python or sys.executable, "-P", "-m", "rlhf_batch", stage, str(config_path), "--iter", str(it)]
    return cmd + list(extra) + [a for o in overrides for a in ("--set", o)] + (["--quiet"] if quiet else [])


def _check_python(python: str) -> None:
    if not os.access(python, os.X_OK):
        raise StageError(f"generate.python: {python} is not an executable interpreter (run `make vllm`?)")


def in_generate_python(
    python: str,
    stage: str,
    config_path: Path,
    it: int,
    overrides: list[str] | None,
    quiet: bool,
    topup: int = 0,
    force: bool = False,
    fanout: tuple[int | None, str | None] | None = None,
) -> None:
    """The `generate` and `eval` commands: with `generate.python` set (and this process not
    running in it), the same command runs in that interpreter, as `run` starts the stage, and
    this process exits with its exit status; otherwise nothing."""
    if not python or os.environ.get(PYTHON_ENV) == python or os.path.abspath(sys.executable) == python:
        return
    _check_python(python)
    rank, world = fanout or (None, None)
    extra = [*(["--topup", str(topup)] if topup else []), *(["--force"] if force else [])]
    extra += [
        *(["--rank", str(rank)] if rank is not None else []),
        *(["--world-size", world] if world else []),
    ]
    cmd = stage_command(python, stage, config_path, it, overrides or [], quiet, *extra)
    env = {**os.environ, PYTHON_ENV: python}
    raise SystemExit(subprocess.run(cmd, preexec_fn=die_with(os.getpid()), env=env).returncode)


def _run_child(
    config_path: Path,
    overrides: list[str],
    stage: str,
    it: int,
    quiet: bool,
    topup: int = 0,
    python: str = "",
    force: bool = False,
) -> None:
    if python:
        _check_python(python)
    extra = (["--topup", str(topup)] if topup else []) + (["--force"] if force else [])
    cmd = stage_command(python, stage, config_path, it, overrides, quiet, *extra)
    env = {**(_group_env() or os.environ), **({PYTHON_ENV: python} if python else {})}
    code = subprocess.run(cmd, preexec_fn=die_with(os.getpid()), env=env).returncode
    if code != 0:
        raise StageError(
            f"{stage} of iteration {it} failed (exit {code}); fix the cause and run again, "
            "completed work is kept"
        )


def _group_env() -> dict[str, str] | None:
    """The stage process's environment: GROUP_ENV says it leads a group of its own (Linux)."""
    from rlhf_batch.runtime.procgroup import GROUP_ENV

    if not sys.platform.startswith("linux"):
        return None
    return {**os.environ, GROUP_ENV: "self"}


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment (so in its children) while the block runs."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def trajectory_line(stage: Any) -> str:
    """The shares of a multi-turn generate's trajectories that were truncated and that ended in
    env_error (its manifest's counts)."""
    from rlhf_batch.observe.status import trajectory_details

    m = manifests.manifest(stage.sdir) or {}
    rows = m.get("rows") or 0
    truncated = (m.get("counts") or {}).get("truncated", 0) / rows if rows else 0.0
    return ", ".join([f"truncated {truncated:.3g}", *trajectory_details(m)])


def warn_health(cfg: Config, it: int) -> None:
    """One warning line on stderr when iteration `it`'s train crossed a health threshold."""
    from rlhf_batch.observe.health import iteration_warning, warning_line

    if warning := iteration_warning(cfg.run_dir, it):
        print(warning_line(it, warning), file=sys.stderr, flush=True)


def warn_reward_health(cfg: Config, it: int) -> None:
    """One warning line on stderr when iteration `it` is flagged by the reward_health view (its
    scores, top-up rounds and eval are complete once it trains). Skipped where no flag can be
    raised yet: before iteration `window` (no earlier iteration to compare with) with fewer than
    two reward parts (no dominant one)."""
    from rlhf_batch.observe.health import REWARD_THRESHOLDS, reward_warning_line
    from rlhf_batch.observe.query import iteration_reward_warning, one_line

    parts = len(cfg.score.reward_functions) + bool(cfg.reward_model)
    if it < REWARD_THRESHOLDS["window"] and parts < 2:
        return
    import duckdb

    try:  # this iteration's files and its baseline's: a cost that does not grow with the run
        warning = iteration_reward_warning(cfg.run_dir, it)
    except duckdb.Error as e:  # a check that could not run stops nothing
        warning = f"not computed ({one_line(e)})"
    if warning:
        print(reward_warning_line(it, warning), file=sys.stderr, flush=True)


def reward_by_iteration(cfg: Config) -> list[dict[str, Any]]:
    """Mean score and reward of each iteration whose scores are complete."""
    import pyarrow.compute as pc

    from rlhf_batch.data.prompts import run_iterations
    from rlhf_batch.store.schemas import SCORES

    out = []
    for it in range(run_iterations(cfg)):
        sdir = layout.folder(cfg.run_dir, it, "scores")
        if manifests.manifest(sdir) is None:
            break
        t = manifests.read_complete(sdir, SCORES, ["score", "reward"])
        out.append({"iter": it, "score": pc.mean(t["score"]).as_py(), "reward": pc.mean(t["reward"]).as_py()})
    return out


def print_summary(cfg: Config) -> None:
    rows = reward_by_iteration(cfg)
    print("iter  mean score  mean reward")
    for r in rows:
        print(f"{r['iter']:>4}  {_fmt(r['score']):>10}  {_fmt(r['reward']):>11}")
    print_eval_summary(cfg)
    try:
        from rlhf_batch.observe.report import write_report

        print(f"report: {write_report(cfg.run_dir, None)}")
    except UserError as e:
        print(f"report: not written ({e})", file=sys.stderr)


def print_eval_summary(cfg: Config) -> None:
    """One line per evaluated iteration and data source: its held-out metrics."""
    from rlhf_batch.observe.status import eval_details

    for it in range(cfg.iterations + 1):
        m = manifests.manifest(layout.folder(cfg.run_dir, it, layout.EVAL))
        for line in eval_details(m) if m is not None else []:
            print(f"eval {it:>4}  {line}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


SAY_PREFIX = ""  # a lane's name, in a lane process (lanes.py)


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(SAY_PREFIX + msg, file=sys.stderr, flush=True)
