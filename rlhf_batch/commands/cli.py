"""The `rlhf-batch` command line: parses arguments and calls library functions, no logic."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from rlhf_batch.runtime import timing  # imported at start: the fallback process start

app = typer.Typer(
    name="rlhf-batch",
    help="Offline batch RL post-training (GRPO with KL control): generate -> score -> advantage -> train.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

ConfigArg = Annotated[Path, typer.Argument(help="TOML config file.", show_default=False)]
IterOpt = Annotated[int, typer.Option("--iter", "-i", help="Iteration number (0-based).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key: --set generate.temperature=0.7 (repeatable)."),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Redo this stage's output (complete, or partial from another config); the old output "
        "is replaced only once the new one is complete.",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
RunDirOpt = Annotated[
    str | None, typer.Option("--run-dir", "-r", help="The run directory (a path or s3://, gs://).")
]
TargetArg = Annotated[
    str | None,
    typer.Argument(
        metavar="CONFIG|RUN_DIR",
        help="The config file or the run directory (default: the current directory).",
        show_default=False,
    ),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="The config file (its run_dir is used).")
]
RankOpt = Annotated[
    int | None,
    typer.Option(
        "--rank",
        help="This process's rank in a fan-out of independent processes (with --world-size N; "
        "default: none). It writes the parts n with n % world size == rank.",
    ),
]
WorldOpt = Annotated[
    str | None,
    typer.Option(
        "--world-size",
        help="The number of processes of the fan-out (see --rank), or `auto`: rank and world size "
        "from the scheduler (a Slurm array or tasks, a Kubernetes Indexed Job with "
        "RLHF_BATCH_WORLD_SIZE, torchrun's group). Without it the environment fans nothing out.",
    ),
]
TopUpOpt = Annotated[
    int,
    typer.Option("--topup", help="A top-up round of the iteration (advantage.min_groups; `run` decides)."),
]


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    if debug:
        os.environ["RLHF_BATCH_DEBUG"] = "1"


def _config(config: Path | None, overrides: list[str] | None):  # noqa: ANN202
    from rlhf_batch.config import load_config

    return load_config(config, overrides)


def _stage(
    name: str,
    config: Path,
    iteration: int,
    overrides: list[str] | None,
    force: bool,
    quiet: bool,
    topup: int = 0,
    fanout: tuple[int | None, str | None] | None = None,
) -> None:
    from rlhf_batch.commands.lanes import use_side
    from rlhf_batch.commands.pipeline import in_generate_python, samples
    from rlhf_batch.runtime import dist
    from rlhf_batch.runtime.device import setup_process
    from rlhf_batch.runtime.procgroup import watch_group
    from rlhf_batch.stages.executor import execute
    from rlhf_batch.stages.registry import get
    from rlhf_batch.store.lock import stage_lock

    cfg = _config(config, overrides)
    if samples(cfg, name):  # sampling: in generate.python's interpreter (vLLM's venv)
        in_generate_python(
            cfg.generate.python, name, config, iteration, overrides, quiet, topup, force, fanout
        )
    watch_group()  # started by `run`: helpers (vLLM's EngineCore) die with this process
    use_side(cfg, name)  # generate.device/threads or train's
    setup_process(cfg.threads)
    if topup < 0:
        from rlhf_batch.errors import UserError

        raise UserError(f"--topup must be >= 0, got {topup}")
    # generate, score, eval: independent processes may share the parts (for this command only)
    with dist.fanout(fanout), stage_lock(cfg.run_dir):
        dist.init(cfg.device)
        stage = get(name)(cfg, iteration, topup) if topup else get(name)(cfg, iteration)
        execute(stage, force=force, quiet=quiet, since=timing.process_start())


@app.command()
def generate(
    config: ConfigArg,
    iteration: IterOpt = 0,
    set_: SetOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    topup: TopUpOpt = 0,
    rank: RankOpt = None,
    world_size: WorldOpt = None,
) -> None:
    """Sample G responses per prompt with the iteration's policy into iter=K/rollouts."""
    _stage("generate", config, iteration, set_, force, quiet, topup, (rank, world_size))


@app.command()
def score(
    config: ConfigArg,
    iteration: IterOpt = 0,
    set_: SetOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    topup: TopUpOpt = 0,
    rank: RankOpt = None,
    world_size: WorldOpt = None,
) -> None:
    """Rewards, reference log-probs, per-token KL and KL-shaped reward into iter=K/scores."""
    _stage("score", config, iteration, set_, force, quiet, topup, (rank, world_size))


@app.command()
def advantage(
    config: ConfigArg,
    iteration: IterOpt = 0,
    set_: SetOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Group advantages by prompt (DuckDB), filters, length-bucketed training parts."""
    _stage("advantage", config, iteration, set_, force, quiet)


@app.command()
def train(
    config: ConfigArg,
    iteration: IterOpt = 0,
    set_: SetOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """GRPO epochs over iter=K/advantages; writes the new policy to iter=K/policy."""
    _stage("train", config, iteration, set_, force, quiet)


@app.command(name="eval")
def eval_(
    config: ConfigArg,
    iteration: IterOpt = 0,
    set_: SetOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    if_due: Annotated[
        bool,
        typer.Option(
            "--if-due",
            help="Do nothing unless `run` would evaluate this iteration ([eval] prompts set; "
            "K = 0, a multiple of eval.every, or = iterations).",
        ),
    ] = False,
    rank: RankOpt = None,
    world_size: WorldOpt = None,
) -> None:
    """Held-out evaluation of iteration K's starting policy: eval.n samples per prompt, rewards,
    mean@n / pass@k / best@n per data source into iter=K/eval."""
    if if_due:
        from rlhf_batch.stages.registry import get

        if not get("eval").runs_at(_config(config, set_), iteration):
            return
    _stage("eval", config, iteration, set_, force, quiet, fanout=(rank, world_size))


@app.command()
def audit(
    config: ConfigArg,
    iterations: Annotated[
        str,
        typer.Option(
            "--iter", "-i", help="An iteration K, or a range A:B (the iterations A..B-1, as a Python slice)."
        ),
    ] = "0",
    set_: SetOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    rank: RankOpt = None,
    world_size: WorldOpt = None,
) -> None:
    """Re-score stored rollouts with score.audit_functions into iter=K/audit (columns audit_<name>,
    never in the reward); scores, advantages and training are left as they are."""
    from rlhf_batch.commands.runs import iteration_range

    for it in iteration_range(iterations):
        _stage("audit", config, it, set_, force, quiet, fanout=(rank, world_size))


@app.command()
def topup(config: ConfigArg, iteration: IterOpt = 0, set_: SetOpt = None, quiet: QuietOpt = False) -> None:
    """Dynamic-sampling top-up rounds of iteration K (generate + score rounds while it has fewer
    informative groups than advantage.min_groups), as `run` does before advantage: for schedulers
    that run the stages as tasks (Airflow). Nothing to do: nothing is done."""
    from rlhf_batch.commands.pipeline import run_topup

    run_topup(config, list(set_ or []), iteration, quiet)


@app.command()
def run(
    config: ConfigArg,
    iterations: Annotated[int | None, typer.Option(help="Iterations to run (default: from config).")] = None,
    set_: SetOpt = None,
    in_process: Annotated[
        bool, typer.Option("--in-process", help="Run every stage in this process.")
    ] = False,
    quiet: QuietOpt = False,
    redo_from: Annotated[
        str | None,
        typer.Option(
            "--redo-from",
            metavar="K[:STAGE]",
            help="Redo stage STAGE of iteration K (default: its first) and every stage after it, "
            "e.g. after a reward fix: 3:score. Each old output stays until its replacement commits; "
            "a killed redo is finished by `run` again.",
        ),
    ] = None,
) -> None:
    """All stages for iterations 0..N-1, skipping completed ones (safe to re-run, cron, Airflow); one
    warning line for each iteration whose train crosses a health threshold, and one for each
    iteration the reward_health view flags (signs of reward hacking)."""
    from rlhf_batch.commands.pipeline import run_pipeline

    overrides = list(set_ or [])
    if iterations is not None:
        overrides.append(f"iterations={iterations}")
    if in_process:
        overrides.append("in_process=true")
    run_pipeline(config, overrides, quiet=quiet, settle_heap=True, redo_from=redo_from)


@app.command(hidden=True)
def lane(
    name: Annotated[str, typer.Argument(help="sample or learn.")],
    config: ConfigArg,
    set_: SetOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """One lane of a `run` with max_staleness > 0 (started by `run`, which holds the lock)."""
    from rlhf_batch.commands.pipeline import run_lane

    run_lane(name, config, list(set_ or []), quiet)


@app.command(name="import")
def import_(
    file: Annotated[
        Path,
        typer.Argument(help="JSONL or Parquet of prompt, response[, prompt_id] rows, or of chat messages."),
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="TOML config (policy_model, temperature); without it, defaults and --set."
        ),
    ] = None,
    run_dir: Annotated[
        str | None, typer.Option("--run-dir", "-r", help="The run directory (default: the config's).")
    ] = None,
    iteration: IterOpt = 0,
    set_: SetOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Turn externally produced (prompt, response) rows, or trajectories as OpenAI-style chat messages
    (a `messages` column: tool calls, tool results, several turns; optionally token_ids, loss_mask,
    behavior_logprobs), into iter=K/rollouts with behaviour log-probs."""
    from rlhf_batch.commands.lanes import use_side
    from rlhf_batch.stages.executor import execute
    from rlhf_batch.stages.importer import Import
    from rlhf_batch.store.lock import stage_lock

    overrides = [*(set_ or []), *([f"run_dir={run_dir}"] if run_dir is not None else [])]
    cfg = _config(config, overrides)
    use_side(cfg, "import")
    with stage_lock(cfg.run_dir):  # never under a running `run` or another command
        stage = Import(cfg, iteration, file)
        execute(stage, force=force, quiet=quiet, since=timing.process_start())


@app.command()
def export(
    config: ConfigArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="The dataset folder to write (absent or empty).")],
    iteration: IterOpt = 0,
    min_reward: Annotated[
        float | None,
        typer.Option(
            "--min-reward", help="Keep only rollouts whose score is at least this (rejection sampling)."
        ),
    ] = None,
    pairs: Annotated[
        bool,
        typer.Option(
            "--pairs",
            help="Write preference pairs instead (prompt, chosen, rejected as messages), chosen per prompt "
            "by advantage.pairs and advantage.pair_margin, for DPO in another trainer.",
        ),
    ] = False,
    set_: SetOpt = None,
) -> None:
    """Write iteration K's rollouts with their rewards as a Hugging Face dataset of chat messages
    (OUT/data/train-00000-of-00001.parquet; multi-turn rollouts one message per turn, tool calls
    included), for SFT or rejection sampling; with --pairs, its preference pairs."""
    from rlhf_batch.observe.export import export as write

    path, rows = write(_config(config, set_), iteration, out, min_reward, pairs)
    typer.echo(f"export: {rows} rows -> {path}")


@app.command()
def validate(config: ConfigArg, set_: SetOpt = None) -> None:
    """Check a config file and report every problem (exit 1 if any): keys, types and values; model
    dirs; the generate and eval prompt files, their id column and repeats; reward function imports
    and arguments against the prompt columns; LoRA's init_adapter and target_modules."""
    from rlhf_batch.commands.checks import validate as check
    from rlhf_batch.config import check_config

    if os.environ.get("RLHF_BATCH_DEBUG"):
        _config(config, set_)  # the first config problem raised where it is found, with its traceback
    cfg, problems = check_config(config, set_)
    ok, more = check(cfg) if cfg is not None else ([], [])
    for line in ok:
        typer.echo(f"  {line}: ok")
    for line in problems + more:  # one line each
        typer.echo(f"error: {line}", err=True)
    if problems or more:
        raise typer.Exit(1)
    typer.echo(f"{config}: ok")


@app.command()
def sql(
    query: Annotated[str | None, typer.Argument(help="SQL; without it, an interactive prompt.")] = None,
    run_dir: RunDirOpt = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="table | csv | json | parquet")] = "table",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the result to this file.")] = None,
    config: ConfigOpt = None,
    timeout: Annotated[
        float,
        typer.Option("--timeout", help="Stop a query still running after this many seconds (0: no limit)."),
    ] = 600.0,
) -> None:
    """DuckDB over the run (read-only): views rollouts, scores, advantages, metrics, health, eval, audit,
    reward_health, prompt_stats, source_stats, turns, objectives, stages with an iter column (rollouts, scores,
    stages: also topup, the dynamic-sampling round)."""
    from rlhf_batch.commands.runs import run_dir_of
    from rlhf_batch.observe.query import run_sql

    run_sql(run_dir_of(None, run_dir, config), query, fmt=fmt, out=out, timeout=timeout)


@app.command()
def status(target: TargetArg = None, run_dir: RunDirOpt = None, config: ConfigOpt = None) -> None:
    """Per iteration and stage: complete / stale / partial / missing, rows, start-up and work seconds, tokens/s,
    mean reward, KL, lengths, train's health (ok, or the thresholds crossed) and the reward_health flags."""
    from rlhf_batch.commands.runs import run_dir_of
    from rlhf_batch.observe.status import print_status

    print_status(run_dir_of(target, run_dir, config))


@app.command()
def report(
    target: TargetArg = None,
    run_dir: RunDirOpt = None,
    config: ConfigOpt = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output dir (default RUN_DIR/report).")
    ] = None,
    tensorboard: Annotated[
        bool, typer.Option("--tensorboard", help="Also write TensorBoard event files.")
    ] = False,
) -> None:
    """PNG plots and report.html: reward, KL, length, time per stage by iteration; train metrics by step;
    the iterations flagged by the health checks."""
    from rlhf_batch.commands.runs import run_dir_of
    from rlhf_batch.observe.report import write_report

    path = write_report(run_dir_of(target, run_dir, config), out, tensorboard=tensorboard)
    typer.echo(f"report: {path}")


@app.command("init-model")
def init_model(
    out_dir: Annotated[
        str, typer.Argument(help="Where to save the model and tokenizer: a folder or a store URI (s3://...).")
    ],
    arch: Annotated[str, typer.Option(help="qwen2 | llama")] = "qwen2",
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 64,
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = 2,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (grouped-query attention).")] = 2,
    intermediate: Annotated[int, typer.Option(help="MLP intermediate size.")] = 128,
    vocab_size: Annotated[int, typer.Option(help="Pad the vocabulary to this size (0: ~100 chars).")] = 0,
    reward: Annotated[
        bool, typer.Option("--reward", help="A 1-label sequence-classification reward model.")
    ] = False,
    pad: Annotated[str, typer.Option(help="Pad token: separate | eos | none")] = "separate",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    shape: Annotated[
        str,
        typer.Option(help="A named shape (tiny, qwen2.5-0.5b): sets hidden, layers, heads, ... and vocab."),
    ] = "",
    dtype: Annotated[
        str,
        typer.Option(
            help="Dtype of the saved weights: float32 | bfloat16 | float16 (train saves in it too)."
        ),
    ] = "float32",
) -> None:
    """Build a tiny random-initialised model and a char-level tokenizer, offline."""
    from rlhf_batch.errors import ConfigError
    from rlhf_batch.models.tiny import DTYPES, SHAPES
    from rlhf_batch.models.tiny import init_model as build

    if shape and shape not in SHAPES:
        raise ConfigError(f"--shape: must be one of {', '.join(SHAPES)}, got {shape!r}")
    sizes = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads}
    sizes |= {"intermediate": intermediate, "vocab_size": vocab_size, **(SHAPES[shape] if shape else {})}
    if arch not in ("qwen2", "llama"):
        raise ConfigError(f"--arch: must be qwen2 or llama, got {arch!r}")
    if pad not in ("separate", "eos", "none"):
        raise ConfigError(f"--pad: must be separate, eos or none, got {pad!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        path = build(out_dir, arch=arch, reward=reward, pad=pad, seed=seed, dtype=dtype, **sizes)  # type: ignore[arg-type]
    except ValueError as e:
        raise ConfigError(f"init-model: {e}") from None
    typer.echo(f"model: {path}")


@app.command("init-prompts")
def init_prompts(
    out: Annotated[
        str, typer.Argument(help="JSONL file to write the demo task's prompts to: a path or a store URI.")
    ],
    n: Annotated[int, typer.Option(help="Number of prompts.")] = 256,
    seed: Annotated[int, typer.Option(help="Seed of the prompt set.")] = 0,
) -> None:
    """Write the procedural demo task's prompt set (no download)."""
    from rlhf_batch.data.demo import write_prompts
    from rlhf_batch.errors import ConfigError

    if n < 1:
        raise ConfigError(f"--n: must be >= 1 prompt, got {n}")
    typer.echo(f"prompts: {write_prompts(out, n, seed)}")


def main() -> None:
    """The console script: runs the command, then exits without tearing the interpreter down."""
    try:
        run_cli()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    exit_now(code)


def exit_now(code: int) -> None:
    """Exit as Python does (non-daemon threads joined, atexit handlers run: trackers, the process
    group, logging; stdout and stderr flushed), then skip the teardown of every module: ~1 s
    with torch and transformers loaded, paid by every stage process."""
    import atexit
    import contextlib
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream
            stream.flush()
    os._exit(code)


def run_cli() -> None:
    """The command line: user errors become one line on stderr and exit code 1 (usage errors: 2)."""
    from rlhf_batch.errors import UserError
    from rlhf_batch.runtime import env

    try:
        env.check()
        # without standalone mode, typer returns (not raises) the code of an Exit, e.g. 130 for Ctrl-C
        code = app(standalone_mode=False, prog_name="rlhf-batch")
        if code == 130:
            raise typer.Abort()
        if isinstance(code, int) and code:
            sys.exit(code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C: one line (a stage process under `run` leaves it to `run`)
        if not os.environ.get("RLHF_BATCH_RUN_LOCKED"):
            print(
                "interrupted: completed parts are kept; run the same command again to go on", file=sys.stderr
            )
        sys.exit(130)
    except typer.TyperException as e:  # a missing argument, an unknown option or command, a bad value
        ctx = getattr(e, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        print(f"error: {where}{e.format_message()} (see --help)", file=sys.stderr)
        sys.exit(2)
    except UserError as e:
        if os.environ.get("RLHF_BATCH_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:  # a file this user cannot read or write, a full disk, a path too long
        from rlhf_batch.errors import os_error_line

        _store_error(e)
        if os.environ.get("RLHF_BATCH_DEBUG"):
            raise
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        _store_error(e)
        if type(e).__module__.lstrip("_") == "duckdb" and not os.environ.get("RLHF_BATCH_DEBUG"):
            print(f"error: {_first_line(e)}", file=sys.stderr)  # a file DuckDB cannot read
            sys.exit(1)
        raise


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _store_error(e: BaseException) -> None:
    """An object store that stopped answering: one line and exit 1 instead of a traceback."""
    from rlhf_batch.store.fs import unreachable

    if not os.environ.get("RLHF_BATCH_DEBUG") and (line := unreachable(e)) is not None:
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
