"""Learning, side by side with TRL: the demo task with rlhf-batch and with TRL's GRPOTrainer.

Both start from the same tiny model (`rlhf_batch.models.tiny.init_model`, `--seeds`, default 0, which
also seed both runs' sampling and prompt order; with several seeds, rows of their mean too) and the same 256
demo prompts, with the same G, learning rate and its cosine schedule, PPO epochs, clip range, prompts per iteration,
rollouts per optimizer step, max new tokens and temperature, no KL, on the same number of torch threads
(`--threads`, default 1: the demo's setting). One setting differs: ours adds the demo's entropy bonus
(`train.entropy_coef`), which TRL's GRPO loss does not have.
Both stop on the same end tokens, never sample the pad token, and score the same text: TRL's
reward decodes `completion_ids` with special tokens kept, as our score stage does (TRL's own
`completions` drop them, which hides a policy that pads its answers with special tokens). Recorded per iteration: the
mean score of the rollouts sampled in that iteration (before training on them); and the wall
time of the whole process (Python start-up, imports, model loads, the loop) and of the loop
alone (ours: every stage of every iteration, in-process as `run` does it with
`in_process = true`; TRL: `trainer.train()`). Rows go to benchmarks/results.md, the curves to
benchmarks/learning.png.

`--task ask` runs the multi-turn demo task instead, with its config pipelines/ask.toml
(rlhf_batch/envs/demo.py: the prompt hides the letter, the model asks, the environment reveals
it, the model answers; score = 0.2 x asking with "?" + 0.8 x the answer's letter_count score;
generate.max_turns 2), ours only (TRL's side would need an environment of its own), rows marked
"(multi-turn)"; `--iterations` defaults to the config's (60).

`--task calc` runs the calculator task (docs/multi-turn.md, "The calculator task": the prompt
"37*58=", the product is the answer) twice from the same tiny model (with the calculator's tokens)
and 1,024 prompts: with the built-in tool environment and calculator (pipelines/calc.toml, ours
column) and without tools (pipelines/calc_no_tools.toml, single-turn, baseline column), the same
budget; rows marked "(calculator)" by iteration: the mean score, the answer score (the product's
digits the last assistant message got right), the share of exact answers and of right calls;
the answer curves go to learning_calculator.png. `--iterations` defaults to the configs' (60).

TRL runs in its own venv, `.venv-trl` (`make trl`, pinned by constraints-trl.txt with the same
torch); without it (as in the smoke test) only rlhf-batch runs and the TRL cells read '-'.

    make bench-learning                      # creates .venv-trl if missing, then runs this
    .venv/bin/python benchmarks/bench_learning.py --iterations 40
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

TRL_PYTHON = common.ROOT / ".venv-trl" / "bin" / "python"
DEMO = common.ROOT / "pipelines" / "demo.toml"
ASK = common.ROOT / "pipelines" / "ask.toml"  # the multi-turn task's config
ASK_ITERATIONS = 60  # pipelines/ask.toml's
CALC = common.ROOT / "pipelines" / "calc.toml"  # the calculator task, with the tool
CALC_NO_TOOLS = common.ROOT / "pipelines" / "calc_no_tools.toml"  # the same without it
CALC_ITERATIONS = 60  # theirs
CONFIGS = {"demo": DEMO, "ask": ASK, "calc": CALC, "calc-no-tools": CALC_NO_TOOLS}
# The settings both sides share: pipelines/demo.toml's (tests/benchmarks/test_smoke.py checks them).
SHARED = {
    "num_generations": 8,
    "prompts_per_iteration": 64,
    "max_new_tokens": 8,
    "temperature": 1.0,
    "lr": 3e-3,
    "lr_schedule": "cosine",
    "total_steps": 160,
    "ppo_epochs": 1,
    "eps": 0.2,
    "max_grad_norm": 1.0,
    "sequences_per_step": 128,
    "iterations": 40,
}
TRL_ROLLOUTS_PER_STEP = SHARED["sequences_per_step"]


def mapping(b: int) -> str:
    per_step = min(TRL_ROLLOUTS_PER_STEP, 8 * b)
    return (
        f"G: num_generations = num_generations (8); prompts/iteration: prompts_per_iteration ({b}) = "
        f"generation_batch_size / num_generations ({8 * b} / 8); PPO epochs: ppo_epochs = num_iterations (1); "
        "clip: eps_low = epsilon (0.2); lr 3e-3 cosine over 160 optimizer steps (ours total_steps, TRL max_steps), "
        "no warmup, AdamW defaults, max_grad_norm 1; "
        "KL: kl_in_reward false, train.kl_loss_coef 0 = beta 0; aggregation token_mean = loss_type 'dapo'; "
        "advantage grpo (r - mean) / (std + 1e-6) = scale_rewards 'group' (std + 1e-4); "
        f"optimizer step: sequences_per_step {per_step} = per_device_train_batch_size "
        f"{per_step} (x steps_per_generation {8 * b // per_step}); max new tokens 8, "
        "temperature 1; both stop on <|endoftext|> and <|im_end|>, never sample <|pad|>, and the reward reads "
        "the text with special tokens kept (TRL's reward decodes completion_ids so); "
        "differences: ours drops zero-variance groups (no rows, no tokens in the normaliser, fewer steps); "
        "ours adds an entropy bonus (train.entropy_coef 0.05), TRL's GRPO loss has none"
    )


def ask_settings() -> str:
    """pipelines/ask.toml's settings, for the rows of the multi-turn task."""
    from rlhf_batch.config import load_config

    c = load_config(ASK, [])
    g, t, a = c.generate, c.train, c.advantage
    return (
        f"pipelines/ask.toml: max_turns {g.max_turns}, max_new_tokens {g.max_new_tokens} per turn, "
        f"temperature {g.temperature}, lr {t.lr:g} {t.lr_schedule} over {t.total_steps} steps, "
        f"sequences_per_step {t.sequences_per_step}, ppo_epochs {t.ppo_epochs}, clip {t.eps_low}, "
        f"entropy_coef {t.entropy_coef}, turn_credit {a.turn_credit} (discount {a.turn_discount:g}), "
        "no KL; score 0.2 x env_asked + 0.8 x env_answer"
    )


def overrides(spec: dict[str, Any]) -> list[str]:
    """The demo config's overrides for ours: the seed's model and prompts, the workload, `set`."""
    out = [f"run_dir={spec['run_dir']}", f"iterations={spec['iterations']}"]
    out += [f"generate.prompts_per_iteration={spec['prompts_per_iteration']}"]
    out += [f"generate.prompts={spec['prompts']}", f"policy_model={spec['model']}", "demo=false"]
    return out + [f"seed={spec['seed']}", f"threads={spec['threads']}", *spec.get("set", [])]


def seed_inputs(tmp: Path, seed: int, task: str = "demo") -> dict[str, str]:
    """The tiny model initialised with `seed` and the 256 demo prompts (the multi-turn task's
    with the letter hidden; the calculator task's: its 1,024 prompts and the model with the
    calculator's tokens), written below `tmp`."""
    from rlhf_batch.data.demo import write_calc_prompts, write_prompts
    from rlhf_batch.models.tiny import CALCULATOR_TOKENS, init_model

    calc = task.startswith("calc")
    model = init_model(Path(tmp, "model"), seed=seed, extra_tokens=CALCULATOR_TOKENS if calc else ())
    where = Path(tmp, "prompts.jsonl")
    prompts = write_calc_prompts(where, 1024) if calc else write_prompts(where, 256, hidden=task == "ask")
    return {"model": str(model), "prompts": str(prompts)}


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from rlhf_batch.commands.pipeline import reward_by_iteration, run_iteration
    from rlhf_batch.config import load_config
    from rlhf_batch.runtime.device import setup_process
    from rlhf_batch.runtime.timing import process_start
    from rlhf_batch.stages.executor import execute
    from rlhf_batch.stages.registry import pipeline

    task = spec.get("task", "demo")
    cfg = load_config(CONFIGS[task], overrides(spec))
    setup_process(cfg.threads)
    pipeline()  # imports (torch, duckdb) before the clock, as TRL's before its loop
    known: list[float] = []

    def run_stage(stage: Any) -> None:
        if stage.name == "advantage":  # every rollout of the iteration is scored: its score is known
            known.append(time.monotonic() - process_start())
        execute(stage, quiet=True)

    t0 = time.perf_counter()
    for it in range(cfg.iterations):  # as `run` with in_process = true (top-up rounds included)
        run_iteration(cfg, it, run_stage, settle_heap=True)
    loop = time.perf_counter() - t0
    out = {"loop_s": loop, "known_s": known, "scores": [r["score"] for r in reward_by_iteration(cfg)]}
    if task.startswith("calc"):
        return {**out, **calc_figures(cfg.run_dir)}
    return {**out, **(turn_figures(cfg.run_dir) if task == "ask" else {})}


def calc_figures(run_dir: str) -> dict[str, list[float]]:
    """The calculator task by iteration: the mean answer score (the product's digits that the last
    assistant turn got right, as the reward's answer part), the share of exact answers, and the
    share of rollouts whose first turn called the calculator on the prompt's expression exactly."""
    import re

    from rlhf_batch.models.tiny import CALL_CLOSE, CALL_OPEN
    from rlhf_batch.observe.query import connect
    from rlhf_batch.rewards.demo import digits

    con = connect(run_dir)
    q = """SELECT r.iter, r.answer, r.expression, r.response,
        (SELECT list(t.text ORDER BY t.segment) FROM turns t
         WHERE t.rollout_id = r.rollout_id AND t.role = 'assistant') AS said
        FROM rollouts r WHERE r.topup = 0 ORDER BY r.iter"""
    by_iter: dict[int, list[tuple[float, float, float]]] = {}
    for it, answer, expression, response, said in con.execute(q).fetchall():
        turns = [re.sub(r"(<\|[a-z_]+\|>)+$", "", t) for t in (said or [response])]
        call = float(f"{CALL_OPEN}{expression}{CALL_CLOSE}" in turns[0])
        by_iter.setdefault(it, []).append((digits(turns[-1], answer), float(turns[-1] == answer), call))
    rows = [list(zip(*v, strict=True)) for _, v in sorted(by_iter.items())]
    return {k: [sum(r[j]) / len(r[j]) for r in rows] for j, k in enumerate(("answer", "exact", "called"))}


def turn_figures(run_dir: str) -> dict[str, list[float]]:
    """The multi-turn task by iteration: mean env_answer (the answer's letter_count score; a
    policy ignoring the environment's answer gets at most 0.2) and the share of answers whose
    first character is the revealed letter (at most 0.2 blind: one letter in five)."""
    from rlhf_batch.observe.query import connect

    con = connect(run_dir)
    q = """SELECT iter, avg(env_answer),
        avg((regexp_extract(response, '<\|im_start\|>assistant\n(.)', 1) = letter)::int)
        FROM rollouts WHERE topup = 0 GROUP BY iter ORDER BY iter"""
    rows = con.execute(q).fetchall()
    return {"answer": [r[1] for r in rows], "first_ok": [r[2] for r in rows]}


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    mod_spec = importlib.util.spec_from_file_location("demo", common.ROOT / "rlhf_batch/rewards/demo.py")
    demo = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
    mod_spec.loader.exec_module(demo)  # type: ignore[union-attr]
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    scores: list[float] = []

    stops, pad = set(spec["stop_ids"]), spec["pad_id"]
    tok = AutoTokenizer.from_pretrained(spec["model"])

    def letter_count(prompts, completions, completion_ids, letter, count, **_):  # noqa: ANN001, ANN202
        # the text our score stage gives the reward: special tokens kept, the final stop token dropped
        # (TRL's `completions` are decoded with skip_special_tokens, which hides padding with them)
        texts = tok.batch_decode(
            [ids[:-1] if ids and ids[-1] in stops else ids for ids in completion_ids],
            skip_special_tokens=False,
        )
        s = demo.letter_count(prompts=prompts, responses=texts, letter=letter, count=count)
        scores.append(sum(s) / len(s))  # one call per generation batch = one iteration
        return s

    g, b = SHARED["num_generations"], spec["prompts_per_iteration"]
    per_step = min(TRL_ROLLOUTS_PER_STEP, g * b)
    steps_per_gen = g * b // per_step
    args = GRPOConfig(
        output_dir=spec["run_dir"],
        use_cpu=True,
        bf16=False,
        seed=spec["seed"],
        learning_rate=SHARED["lr"],
        lr_scheduler_type=SHARED["lr_schedule"],
        warmup_steps=0,
        max_grad_norm=SHARED["max_grad_norm"],
        num_generations=g,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_gen,
        num_iterations=SHARED["ppo_epochs"],
        max_steps=spec["iterations"] * steps_per_gen * SHARED["ppo_epochs"],
        epsilon=SHARED["eps"],
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        max_completion_length=SHARED["max_new_tokens"],
        temperature=SHARED["temperature"],
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        generation_kwargs={"suppress_tokens": [pad]},  # as ours: the pad token is never sampled
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.generation_config.eos_token_id = sorted(stops)  # as ours: stop on every end token
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=letter_count,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    t0 = time.perf_counter()
    trainer.train()
    return {"loop_s": time.perf_counter() - t0, "scores": scores}


def end_tokens(model: Path) -> dict[str, Any]:
    """The tokens our generate stops on and never samples, for TRL to do the same."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from rlhf_batch.engines.base import stop_ids as _stop_ids
    from rlhf_batch.models.load import load_tokenizer

    tok = load_tokenizer(str(model))
    holder = SimpleNamespace(generation_config=GenerationConfig.from_pretrained(model))
    return {"stop_ids": sorted(_stop_ids(holder, tok)), "pad_id": tok.pad_token_id}


def run_side(python: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One side in a fresh process: its figures plus the whole process's wall time."""
    import resource

    cmd = [str(python), __file__, "--worker", name, "--spec", json.dumps(spec)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT, timeout=7200)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench_learning: the {name} worker failed:\n{proc.stderr[-4000:]}")
    # CPU seconds (user + system) of the process: on a shared machine, what wall time would be alone
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": wall, "process_cpu_s": cpu}


def best(scores: list[float]) -> tuple[float, int]:
    i = max(range(len(scores)), key=lambda k: scores[k])
    return scores[i], i


def plot(
    path: Path,
    ours: list[float],
    trl: list[float] | None,
    title: str,
    labels: tuple[str, str] = ("rlhf-batch", "TRL GRPOTrainer"),
    ylabel: str = "mean score of the iteration's rollouts",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(ours)), ours, marker=".", label=labels[0])
    if trl:
        ax.plot(range(len(trl)), trl, marker=".", label=labels[1])
    ax.set(xlabel="iteration", ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_seed(
    seed: int, iterations: int, b: int, threads: int, use_trl: bool, ours_set: list[str], task: str = "demo"
) -> tuple[dict, dict | None]:
    """Both sides from the same tiny model (initialised with `seed`) and prompts."""
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        inputs = seed_inputs(Path(tmp), seed, task)
        spec = {
            **inputs,
            "iterations": iterations,
            "prompts_per_iteration": b,
            "seed": seed,
            "threads": threads,
            **end_tokens(Path(inputs["model"])),
        }
        ours_spec = {**spec, "run_dir": str(Path(tmp, "ours")), "set": ours_set, "task": task}
        ours = run_side(Path(sys.executable), "ours", ours_spec)
        trl = run_side(TRL_PYTHON, "trl", {**spec, "run_dir": str(Path(tmp, "trl"))}) if use_trl else None
    return ours, trl


def record(results: Path, what: str, workload: str, note: str, ours: dict, trl: dict | None) -> None:
    """The three rows of one comparison: scores by iteration, best score, wall time. The targets:
    ours reaches TRL's best score in no more iterations, and in at most half the wall time of
    TRL's whole process (ours reaches it when the score stage of that iteration ends, counted
    from our process's start)."""
    fmt = " ".join(f"{s:.3f}" for s in ours["scores"])
    tfmt = " ".join(f"{s:.3f}" for s in trl["scores"]) if trl else "- (no .venv-trl: make trl)"
    common.append_row(results, f"learning: mean score by iteration{what}", workload, "mean score", fmt, tfmt)
    if "answer" in ours:  # the multi-turn task: turn 2 against a blind policy's 0.2
        for key, what_ in (
            ("answer", "answer score (env_answer)"),
            ("first_ok", "answers starting with the letter"),
        ):
            cells = " ".join(f"{s:.3f}" for s in ours[key])
            common.append_row(
                results,
                f"learning: {what_} by iteration{what}",
                "as above",
                "share",
                cells,
                target="> 0.2 (blind: at most 0.2)",
                met=max(ours[key]) > 0.2,
            )
    ob, oi = best(ours["scores"])
    target, met, reach = "-", None, None
    cells = {"baseline": "-", "ratio": "-"}
    if trl:
        tb, ti = best(trl["scores"])
        reach = next((k for k, s in enumerate(ours["scores"]) if s >= tb), None)
        cells = {"baseline": f"{tb:.3f} at iteration {ti}"}
        cells["ratio"] = (
            f"ours reaches it at iteration {reach}" if reach is not None else "ours does not reach it"
        )
        target = "TRL's best score in no more iterations"
        met = reach is not None and reach <= ti
    common.append_row(
        results,
        f"learning: best score{what}",
        "as above",
        "best mean score (iteration)",
        f"{ob:.3f} at iteration {oi}",
        cells["baseline"],
        cells["ratio"],
        target=target,
        met=met,
    )

    def times(r: dict[str, Any]) -> str:
        return f"whole process {r['process_s']:.0f}s (CPU {r['process_cpu_s']:.0f}s), loop {r['loop_s']:.0f}s"

    whole, t_whole, ratio, met = times(ours), times(trl) if trl else "-", "-", None
    if trl:
        ratio = f"{trl['process_s'] / ours['process_s']:.1f}x (whole processes)"
        if reach is not None:
            at = ours["known_s"][reach]
            whole += f"; TRL's best reached after {at:.1f}s"
            ratio += f"; {trl['process_s'] / at:.1f}x (ours to TRL's best vs TRL's whole process)"
        met = reach is not None and ours["known_s"][reach] * 2 <= trl["process_s"]
    common.append_row(
        results,
        f"learning: wall time{what}",
        f"as above; {note}" if note else "as above",
        "wall time",
        whole,
        t_whole,
        ratio,
        target="TRL's best score in <= TRL's whole process / 2" if trl else "-",
        met=met,
    )


def mean_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of several seeds as one: scores, times and per-iteration times averaged."""
    avg = lambda key: [sum(x) / len(runs) for x in zip(*(r[key] for r in runs), strict=True)]  # noqa: E731
    return {
        "scores": avg("scores"),
        "known_s": avg("known_s") if "known_s" in runs[0] else [],
        **{k: avg(k) for k in ("answer", "first_ok", "exact", "called") if k in runs[0]},
        **{k: sum(r[k] for r in runs) / len(runs) for k in ("process_s", "process_cpu_s", "loop_s")},
    }


def run_calc_seed(seed: int, iterations: int, b: int, threads: int, sets: list[str]) -> tuple[dict, dict]:
    """The calculator task from the model initialised with `seed`: with the tool, then without."""
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        spec = {
            **seed_inputs(Path(tmp), seed, "calc"),
            "iterations": iterations,
            "prompts_per_iteration": b,
            "seed": seed,
            "threads": threads,
            "set": sets,
        }
        runs = [
            run_side(Path(sys.executable), "ours", {**spec, "run_dir": str(Path(tmp, task)), "task": task})
            for task in ("calc", "calc-no-tools")
        ]
    return runs[0], runs[1]


def record_calc(results: Path, what: str, workload: str, tools: dict, alone: dict, note: str = "") -> None:
    """The rows of one comparison: with the tool (ours column) against without (baseline)."""
    cells = lambda r, k: " ".join(f"{s:.3f}" for s in r[k])  # noqa: E731
    for key, name, unit in (
        ("scores", "mean score", "mean score"),
        ("answer", "answer score (digits of the product right)", "share"),
        ("exact", "exact answers", "share"),
        ("called", "right calls (the prompt's expression)", "share"),
    ):
        common.append_row(
            results,
            f"learning: {name} by iteration{what}",
            workload if key == "scores" else "as above",
            unit,
            cells(tools, key),
            cells(alone, key),
        )
    (tb, ti), (ab, ai) = best(tools["answer"]), best(alone["answer"])
    common.append_row(
        results,
        f"learning: best answer score{what}",
        "as above",
        "best answer score (iteration)",
        f"{tb:.3f} at iteration {ti}",
        f"{ab:.3f} at iteration {ai}",
        f"{tb / ab:.1f}x" if ab else "-",
        target="with the tool above without it",
        met=tb > ab,
    )
    times = lambda r: f"whole process {r['process_s']:.0f}s (CPU {r['process_cpu_s']:.0f}s)"  # noqa: E731
    where = f"as above; {note}" if note else "as above"
    common.append_row(results, f"learning: wall time{what}", where, "wall time", times(tools), times(alone))


def main_calc(args: Any, seeds: list[int]) -> None:
    """--task calc: per seed, the calculator task with the tool and without (module docstring)."""
    from rlhf_batch.config import load_config

    iterations = 2 if args.tiny else args.iterations or CALC_ITERATIONS
    b = 16 if args.tiny else SHARED["prompts_per_iteration"]
    common.CACHE.mkdir(parents=True, exist_ok=True)
    c = load_config(CALC, [])
    g, t = c.generate, c.train

    def workload(seed_text: str) -> str:
        return (
            f"calculator task, 1,024 prompts 'a*b=' (a, b in 32-99), {b} per iteration x G 8, "
            f"{iterations} iterations, tiny Qwen2 (2 layers, {seed_text}, the calculator's 4 added "
            f"tokens), {args.threads} torch thread(s); ours: pipelines/calc.toml (built-in tool "
            f"environment, calculator, hermes calls, max_turns {g.max_turns}); baseline: "
            f"pipelines/calc_no_tools.toml (single-turn); both max_new_tokens {g.max_new_tokens} per turn, "
            f"lr {t.lr:g} {t.lr_schedule} over {t.total_steps} steps, ppo_epochs {t.ppo_epochs}, "
            f"sequences_per_step {t.sequences_per_step}, entropy_coef {t.entropy_coef}, no KL; "
            "score 0.2 x call + 0.8 x answer (rlhf_batch.rewards.demo:calculator)"
            + (f"; both with {', '.join(args.set)}" if args.set else "")
        )

    runs = [run_calc_seed(seed, iterations, b, args.threads, args.set) for seed in seeds]
    for seed, (tools, alone) in zip(seeds, runs, strict=True):
        record_calc(args.results, " (calculator)", workload(f"seed {seed}"), tools, alone, args.note)
    if len(seeds) > 1:
        tools, alone = mean_of([r[0] for r in runs]), mean_of([r[1] for r in runs])
        what = " (calculator), mean over seeds"
        record_calc(args.results, what, workload(f"seeds {args.seeds}"), tools, alone, args.note)
    png = args.png or args.results.parent / "learning_calculator.png"
    title = f"calculator task, answer score, {b} prompts x 8 per iteration" + (
        f", mean of seeds {args.seeds}" if len(seeds) > 1 else f", seed {seeds[0]}"
    )
    plot(
        png, tools["answer"], alone["answer"], title, ("with the calculator", "without tools"), "answer score"
    )
    print(f"plot: {png}")


def main() -> None:
    p = common.parser(__doc__ or "")
    p.add_argument("--iterations", type=int, help="default: the config's (demo 40, ask 60)")
    p.add_argument("--png", type=Path, help="default: learning.png beside --results")
    p.add_argument("--no-trl", action="store_true", help="run rlhf-batch only")
    p.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds (the model's init, both runs' sampling and prompt order); "
        "with several, rows per seed and rows of the mean over seeds",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for ours (repeatable)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of each side (default 1, as the demo)"
    )
    p.add_argument("--note", default="", help="appended to the wall-time row (e.g. the machine's load)")
    p.add_argument(
        "--task",
        choices=["demo", "ask", "calc"],
        default="demo",
        help="ask: the multi-turn demo task; calc: the calculator task, with the tool and without",
    )
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.spec)
        common.emit(worker_ours(spec) if args.worker == "ours" else worker_trl(spec))
        return
    seeds = [int(x) for x in args.seeds.split(",")]
    if args.task == "calc":
        main_calc(args, seeds)
        return
    iterations = (
        2
        if args.tiny
        else args.iterations or (ASK_ITERATIONS if args.task == "ask" else SHARED["iterations"])
    )
    b = 16 if args.tiny else SHARED["prompts_per_iteration"]
    use_trl = not args.no_trl and TRL_PYTHON.exists() and args.task == "demo"
    what = " (multi-turn)" if args.task == "ask" else ""
    common.CACHE.mkdir(parents=True, exist_ok=True)

    def workload(seed_text: str) -> str:
        return (
            ("multi-turn ask-letter task, " if args.task == "ask" else "")
            + f"demo task, 256 prompts, {b} per iteration x G 8, {iterations} iterations, tiny Qwen2 "
            f"(2 layers, {seed_text}), {args.threads} torch thread(s) each; "
            + (ask_settings() if args.task == "ask" else mapping(b))
            + (f"; ours with {', '.join(args.set)}" if args.set else "")
        )

    runs = []
    for seed in seeds:
        ours, trl = run_seed(seed, iterations, b, args.threads, use_trl, args.set, args.task)
        record(args.results, what, workload(f"seed {seed}"), args.note, ours, trl)
        runs.append((ours, trl))
    if len(seeds) > 1:
        ours = mean_of([o for o, _ in runs])
        trl = mean_of([t for _, t in runs if t]) if use_trl else None
        record(
            args.results, what + ", mean over seeds", workload(f"seeds {args.seeds}"), args.note, ours, trl
        )
    png = args.png or args.results.parent / ("learning_multiturn.png" if what else "learning.png")
    title = ("multi-turn " if what else "") + f"demo task, {b} prompts x 8 per iteration"
    if len(seeds) > 1:
        title += f", mean of seeds {args.seeds}" if len(seeds) <= 4 else f", mean of {len(seeds)} seeds"
    plot(png, ours["scores"], trl["scores"] if trl else None, title)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
