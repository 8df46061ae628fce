"""The GPU benchmark at a realistic size: one command on one H100/H200 (at most ~8 minutes).

    make wheels          # here, with a network (as for the GPU check)
    make gpu-bench       # there: python benchmarks/gpu_bench.py --wheels wheels
    python benchmarks/gpu_bench.py --tiny --no-install --out /tmp/b   # the same path on a CPU

It installs the project offline from the wheel folder as benchmarks/gpu_check.py does (its
`install`), builds a Qwen2.5-0.5B-shaped random policy with `rlhf-batch init-model --shape` saved
in bf16 (`init-model --dtype bfloat16`), generates 128 prompts x 8 samples x 1024 new
tokens with the generate stage (random weights rarely sample an end token: responses run to the
limit), then scores and trains on those rows in this process:

- per stage, **steady-state** tokens/s: the first batch (kernel selection, allocator warm-up) is
  left out, and no load or save is inside the timed span; each fixed cost separately: imports,
  CUDA start, model load, optimizer state save and load, policy save;
- MFU against the bf16 matmul peak measured here (train counted as 3x the forward FLOPs), peak
  GPU memory, host syncs per train micro-batch (torch.cuda.set_sync_debug_mode);
- side by side, on the same rows, an anchor computed as TRL's GRPOTrainer computes it: padded
  micro-batches of `per_device_train_batch_size` rows (prompts left-padded, completions right-
  padded, attention mask), full logits of the completion positions, `selective_log_softmax`'s
  torch path (bf16 logits: a log_softmax per row), the clipped loss, `loss.backward()` and a
  fused AdamW step; score: the same forward without gradients.

Train and its anchor run whole optimizer steps until `--train-seconds` of steady state (each
at least two steps). If benchmarks/gpu_bench_generate.py exists, its `compare(ctx)` runs after
generation and its rows are recorded too. Writes OUT/gpu_bench.json and OUT/gpu_bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SIZES = {
    "qwen2.5-0.5b": {"prompts": 128, "g": 8, "new": 1024, "mb_rows": 8, "peak_n": 8192, "seconds": 40.0}
    | {"score_groups": 8, "step_tokens": 65536, "mb_tokens": 16384},
    "tiny": {"prompts": 4, "g": 2, "new": 8, "mb_rows": 2, "peak_n": 256, "seconds": 0.0}
    | {"score_groups": 1, "step_tokens": 16, "mb_tokens": 24},
}


def timed(costs: dict[str, float], name: str) -> Any:
    """A context that records its wall seconds (after a device sync) as costs[name]."""

    @contextlib.contextmanager
    def span() -> Iterator[None]:
        _sync()
        t0 = time.perf_counter()
        yield
        _sync()
        costs[name] = round(time.perf_counter() - t0, 3)

    return span()


def _sync() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def import_seconds() -> float:
    """A fresh process's imports of what a model stage imports (torch, transformers, ours)."""
    code = (
        "import time; t = time.perf_counter(); import torch, transformers; "
        "import rlhf_batch.stages.train.step, rlhf_batch.models.forward; print(time.perf_counter() - t)"
    )
    return round(
        float(
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        ),
        3,
    )


def prepare(args: argparse.Namespace, work: Path, size: dict[str, Any]) -> dict[str, Any]:
    """The bf16 policy, the prompts, the config; the generate stage's rollouts."""
    import gpu_check

    policy = work / "policy"
    gpu_check.cli("init-model", str(policy), "--shape", args.shape, "--dtype", "bfloat16")
    saved = "bfloat16"
    gpu_check.cli("init-prompts", str(work / "prompts.jsonl"), "--n", str(size["prompts"]))
    (work / "config.toml").write_text(
        f'run_dir = "{work / "run"}"\npolicy_model = "{policy}"\ndevice = "{args.device}"\n'
        f'dtype = "bfloat16"\nseed = 0\n[generate]\nprompts = "{work / "prompts.jsonl"}"\n'
        f"num_generations = {size['g']}\nprompts_per_iteration = {size['prompts']}\n"
        f"max_new_tokens = {size['new']}\nbatch_size = {size['prompts'] * size['g']}\n"
        f'[score]\nreward_functions = ["gpu_check:spread"]\nreward_paths = ["{HERE}"]\n'
    )
    gpu_check._run(
        [sys.executable, "-m", "rlhf_batch", "generate", str(work / "config.toml"), "--iter", "0"],
        "rlhf-batch generate",
        {"PYTHONPATH": str(HERE)},
    )
    manifest = json.loads((work / "run/iter=0000/rollouts/_manifest.json").read_text())
    return {"saved_dtype": saved, "generate": manifest.get("timing", {})}


def rollouts(work: Path) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    import pyarrow.parquet as pq

    cols = ["prompt_ids", "response_ids", "behavior_logprobs"]
    t = pq.read_table(work / "run/iter=0000/rollouts", columns=cols).to_pydict()
    return t["prompt_ids"], t["response_ids"], t["behavior_logprobs"]


def steady(batches: list[Any], run: Callable[[Any], int], seconds: float) -> dict[str, Any]:
    """Run `batches` in order (the first one outside the timed span); stop after `seconds` of
    steady state when it is > 0 (at least 2 timed batches) -> tokens, seconds, tokens/s, peak."""
    import torch

    run(batches[0])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t0, tokens, n = time.perf_counter(), 0, 0
    for b in batches[1:]:
        tokens += run(b)
        n += 1
        _sync()
        if seconds and n >= 2 and time.perf_counter() - t0 > seconds:
            break
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {
        "tokens": tokens,
        "seconds": round(dt, 3),
        "tokens_per_s": tokens / max(dt, 1e-9),
        "batches": n,
        "peak_gpu_bytes": peak,
    }


def score_ours(model: Any, prompts: list, responses: list, groups: int) -> Callable[[Any], int]:
    from rlhf_batch.models.forward import batched_logprobs

    def run(rows: list[int]) -> int:
        batched_logprobs(
            model, [prompts[i] for i in rows], [responses[i] for i in rows], 1.0, pad_id=0, max_tokens=16384
        )
        return sum(len(prompts[i]) + len(responses[i]) for i in rows)

    return run


def trl_forward(model: Any, prompts: list, responses: list, rows: list[int], device: str) -> tuple[Any, Any]:
    """TRL's `_get_per_token_logps` on one micro-batch: prompts left-padded, completions right-
    padded, the model's full logits of the completion positions, `selective_log_softmax`'s torch
    path (16-bit logits: log_softmax row by row) -> (logps [B, C], completion mask [B, C])."""
    import torch
    import torch.nn.functional as F

    p_len, c_len = max(len(prompts[i]) for i in rows), max(len(responses[i]) for i in rows)
    ids = torch.zeros(len(rows), p_len + c_len, dtype=torch.long)
    att = torch.zeros_like(ids)
    for k, i in enumerate(rows):
        p, r = prompts[i], responses[i]
        ids[k, p_len - len(p) : p_len], ids[k, p_len : p_len + len(r)] = torch.tensor(p), torch.tensor(r)
        att[k, p_len - len(p) : p_len + len(r)] = 1
    ids, att = ids.to(device), att.to(device)
    logits = model(input_ids=ids, attention_mask=att, logits_to_keep=c_len + 1).logits[:, :-1]  # [B, C, V]
    index = ids[:, -c_len:]
    if logits.dtype in (torch.float32, torch.float64):
        lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        logps = torch.gather(logits, -1, index[..., None]).squeeze(-1) - lse
    else:
        logps = torch.stack(
            [
                F.log_softmax(lg, -1).gather(-1, ix[:, None]).squeeze(-1)
                for lg, ix in zip(logits, index, strict=True)
            ]
        )
    return logps, att[:, p_len:]


def train_ours(model_dir: Path, data: Any, device: str, bf16: bool) -> tuple[Any, Callable[[Any], int]]:
    import torch

    from rlhf_batch.config import TrainConfig
    from rlhf_batch.models.load import load_model
    from rlhf_batch.stages.train.step import LogProbs, Trainer

    model = load_model(str(model_dir), "policy", device=device, dtype="float32")
    model.train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=torch.device(device).type in ("cpu", "cuda"))
    kw = dict(eps_low=0.2, eps_high=0.2, dual_clip=None, aggregation="token_mean", kl_coef=0.0)
    kw |= dict(entropy_coef=0.0, norm_const=None, kl_to_inference_coef=0.0, tis_cap=0.0)
    tr = Trainer(model, LogProbs(model, 1.0, 0), opt, data, TrainConfig(), kw, 1, device, 1, 0, bf16, None)

    def run(step: Any) -> int:
        tr.step(step)
        return int(sum(data.seq_lens[i] for mb in step.micro for i in mb))

    return tr, run


def train_trl(
    model_dir: Path, prompts: list, responses: list, old: list, adv: list, device: str, bf16: bool
) -> Callable[[Any], int]:
    """One TRL-style optimizer step over a list of micro-batches (row lists)."""
    import torch

    from rlhf_batch.models.load import load_model

    model = load_model(str(model_dir), "policy", device=device, dtype="float32")
    model.train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=torch.device(device).type in ("cpu", "cuda"))

    def run(micro: list[list[int]]) -> int:
        for rows in micro:
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                logps, mask = trl_forward(model, prompts, responses, rows, device)
            logps = logps.float()
            c = logps.shape[1]
            o = torch.tensor([old[i] + [0.0] * (c - len(old[i])) for i in rows], device=device)
            a = torch.tensor([adv[i] for i in rows], device=device)[:, None]
            ratio = torch.exp(logps - o)
            loss_tok = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
            loss = (loss_tok * mask).sum() / mask.sum().clamp(min=1) / len(micro)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sum(len(prompts[i]) + len(responses[i]) for rows in micro for i in rows)

    return run


def train_rows(prompts: list, responses: list, old: list, adv: list) -> Any:
    import numpy as np

    from rlhf_batch.stages.train.data import TrainRows, _offsets

    seq = np.array([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)])
    resp = np.array([len(r) for r in responses])
    return TrainRows(
        rollout_ids=[str(i) for i in range(len(prompts))],
        ids=np.array([t for p, r in zip(prompts, responses, strict=True) for t in (*p, *r)], np.int64),
        ids_off=_offsets(seq),
        prompt_lens=np.array([len(p) for p in prompts], np.int64),
        old=np.array([x for o in old for x in o], np.float32),
        ref=None,
        resp_off=_offsets(resp),
        adv=np.array(adv, np.float32),
    )


def generate_compare(
    work: Path, prompts: list, size: dict[str, Any], device: str
) -> list[dict[str, Any]] | None:
    """The rows of benchmarks/gpu_bench_generate.py's `compare(ctx)` when that module exists."""
    if importlib.util.find_spec("gpu_bench_generate") is None:
        return None
    import gpu_bench_generate

    firsts = list(dict.fromkeys(tuple(p) for p in prompts))  # each prompt once, in order
    ctx = {"model_dir": str(work / "policy"), "prompt_ids": [list(p) for p in firsts]}
    ctx |= {
        "max_new_tokens": size["new"],
        "device": device,
        "dtype": "bfloat16",
        "num_generations": size["g"],
    }
    return list(gpu_bench_generate.compare(ctx))


def host_syncs_per_micro_batch(tr: Any, step: Any) -> float | None:
    """CUDA's own count: the warnings of torch.cuda.set_sync_debug_mode over one step, less the
    step's own reads (those of a step of one micro-batch), per further micro-batch."""
    import warnings

    import torch

    from rlhf_batch.stages.train.data import Step

    if not torch.cuda.is_available() or len(step.micro) < 2:
        return None
    counts = []
    for micro in (step.micro[:1], step.micro):
        s = Step(step.index, step.epoch, micro, step.tokens, step.sequences, step.filler)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tr.step(s)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
    return (counts[1] - counts[0]) / (len(step.micro) - 1)


def fixed_costs_of_train(tr: Any, work: Path, fixed: dict[str, float]) -> None:
    """Optimizer state save and load, policy save, as the train stage does them."""
    import torch

    from rlhf_batch.models import optim_state
    from rlhf_batch.stages.train import carry as train_carry
    from rlhf_batch.stages.train import save

    opt_dir = work / "optimizer"
    with timed(fixed, "optimizer_save_s"):
        train_carry.save(opt_dir, tr.optimizer.state_dict(), tr.model, {})
    names = optim_state.param_names(tr.model)
    with timed(fixed, "optimizer_load_s"):
        tr.optimizer.load_state_dict(
            optim_state.load(opt_dir, names, False, device=next(tr.model.parameters()).device)
        )
    from rlhf_batch.models.load import load_tokenizer

    tok = load_tokenizer(str(work / "policy"))
    with timed(fixed, "policy_save_s"):
        save._write_policy(tr.model, tok, work / "policy-out", torch.bfloat16, False)


def mfu(
    tokens_per_s: float, passes: int, body: int, head: int, resp_share: float, peak_tflops: float
) -> float:
    """Model FLOPs per second over the bf16 peak: 2 FLOPs per matmul parameter per token
    forward (the LM head's per response token), x passes (train: 3)."""
    return 2 * passes * (body + head * resp_share) * tokens_per_s / (peak_tflops * 1e12)


def bench(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import random
    import shutil

    import gpu_numerics

    size, dev = SIZES[args.shape], args.device
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fixed: dict[str, float] = {"imports_s": import_seconds()}
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": dev}
    report |= {"shape": args.shape, "sizes": size, "fixed": fixed, "stages": {}}
    import torch

    with timed(fixed, "device_start_s"):
        torch.zeros(1, device=dev)
    report["device_name"] = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    report |= prepare(args, work, size)
    prompts, responses, beh = rollouts(work)
    report["responses_at_limit"] = sum(len(r) == size["new"] for r in responses) / len(responses)
    report["generate_compare"] = generate_compare(work, prompts, size, dev)
    peak = report["peak_tflops"] = gpu_numerics.matmul_peak(dev, size["peak_n"])
    body, head = gpu_numerics.flop_params(work / "policy")
    resp_share = sum(map(len, responses)) / sum(
        len(p) + len(r) for p, r in zip(prompts, responses, strict=True)
    )
    bf16 = True
    from rlhf_batch.models.load import load_model

    with timed(fixed, "score_model_load_s"):
        model = load_model(str(work / "policy"), "reference", device=dev, dtype="bfloat16")
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i], i))  # a prompt's samples adjacent
    per = size["score_groups"] * size["g"]  # whole groups per call
    ours = steady(
        [order[i : i + per] for i in range(0, len(order), per)],
        score_ours(model, prompts, responses, size["g"]),
        0,
    )

    def trl_score(rows: list[int]) -> int:
        with torch.inference_mode():
            trl_forward(model, prompts, responses, rows, dev)
        return sum(len(prompts[i]) + len(responses[i]) for i in rows)

    mb = size["mb_rows"]
    anchor = steady([order[i : i + mb] for i in range(0, len(order), mb)], trl_score, size["seconds"])
    report["stages"]["score"] = {"ours": ours, "anchor": anchor}
    model = None  # freed before train loads its own
    rng = random.Random(0)
    adv = [rng.gauss(0.0, 1.0) for _ in prompts]
    data = train_rows(prompts, responses, beh, adv)
    from rlhf_batch.stages.train.data import plan_steps

    steps = plan_steps(data.resp_lens, data.seq_lens, size["step_tokens"], size["mb_tokens"], 1, (0, 0))
    with timed(fixed, "train_model_load_s"):
        tr, run = train_ours(work / "policy", data, dev, bf16)
    ours = steady(steps, run, size["seconds"])
    ours["host_syncs_per_micro_batch"] = host_syncs_per_micro_batch(tr, steps[-1])
    fixed_costs_of_train(tr, work, fixed)
    del tr, run
    torch.cuda.empty_cache() if dev == "cuda" else None
    trl_steps = [
        [[i for i in rows][k : k + mb] for k in range(0, len(rows), mb)]
        for rows in ([i for m in s.micro for i in m] for s in steps)
    ]
    anchor = steady(
        trl_steps, train_trl(work / "policy", prompts, responses, beh, adv, dev, bf16), size["seconds"]
    )
    report["stages"]["train"] = {"ours": ours, "anchor": anchor}
    for name, passes in (("score", 1), ("train", 3)):
        for side in ("ours", "anchor"):
            s = report["stages"][name][side]
            s["mfu"] = mfu(s["tokens_per_s"], passes, body, head, resp_share, peak)
        st = report["stages"][name]
        st["ratio"] = st["ours"]["tokens_per_s"] / max(st["anchor"]["tokens_per_s"], 1e-9)
    g = report["generate"]
    if g.get("tokens_per_s"):
        g["mfu"] = mfu(g["tokens_per_s"], 1, body, head, resp_share, peak)
    return report


def table(r: dict[str, Any]) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    lines = [
        f"GPU bench {r['started']}: {r['device_name']}, shape {r['shape']} saved in {r['saved_dtype']}, "
        f"{r['sizes']['prompts']} prompts x {r['sizes']['g']} samples x {r['sizes']['new']} new tokens "
        f"({100 * r['responses_at_limit']:.0f}% of responses at the limit), bf16 matmul peak {r['peak_tflops']:.3g} TFLOP/s",
        "",
        "| stage | ours tokens/s | ours MFU | anchor (TRL-style) tokens/s | anchor MFU | ratio | ours peak memory | anchor peak memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    g = r["generate"]
    lines.append(
        f"| generate (stage, work only) | {g.get('tokens_per_s') or 0:.0f} | {100 * g.get('mfu', 0):.1f}% | - | - | - | - | - |"
    )
    for name in ("score", "train"):
        s = r["stages"][name]
        o, a = s["ours"], s["anchor"]
        lines.append(
            f"| {name} (steady state) | {o['tokens_per_s']:.0f} | {100 * o['mfu']:.1f}% | {a['tokens_per_s']:.0f} | "
            f"{100 * a['mfu']:.1f}% | {s['ratio']:.2f}x | {gib(o['peak_gpu_bytes'])} | {gib(a['peak_gpu_bytes'])} |"
        )
    syncs = r["stages"]["train"]["ours"].get("host_syncs_per_micro_batch")
    lines += [
        "",
        f"host syncs per train micro-batch (CUDA sync debug mode): {'-' if syncs is None else f'{syncs:.1f}'}",
    ]
    lines += ["", "fixed costs: " + ", ".join(f"{k} {v:.2f}" for k, v in r["fixed"].items())]
    lines.append(f"generate stage: start-up {g.get('startup_s', 0):.1f} s, work {g.get('work_s', 0):.1f} s")
    for row in r.get("generate_compare") or []:
        lines.append("generate comparison: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    return "\n".join(lines) + "\n"


def main() -> int:
    import gpu_check

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shape", choices=tuple(SIZES), default="qwen2.5-0.5b")
    p.add_argument(
        "--tiny", action="store_true", help="--device cpu --shape tiny --no-install (the smoke test)"
    )
    p.add_argument("--wheels", default="wheels", help="the folder `make wheels` wrote")
    p.add_argument("--venv", default=".venv-gpu", help="where to install it (sees the machine's torch)")
    p.add_argument("--no-install", action="store_true", help="use the rlhf_batch this Python imports")
    p.add_argument("--out", type=Path, default=Path("gpu_bench"), help="report and work folder")
    args = p.parse_args()
    args.out = args.out.resolve()  # once: the config written below names its models by absolute path
    if args.tiny:
        args.device, args.shape, args.no_install = "cpu", "tiny", True
    if not args.no_install:
        try:
            return gpu_check.install(args, __file__)
        except gpu_check.Failure as e:
            print(f"gpu_bench: FAILED\n{e}", file=sys.stderr)
            return 1
    report = bench(args, args.out)
    (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_bench.md").write_text(text := table(report))
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
