"""Generation on one device: our sampler at generate.batch_size = "auto" against plain
transformers `model.generate` on the same prompts, and bare vLLM (plus our vllm engine's request
shaping on the same vLLM engine) where vLLM is importable.

`compare(ctx)` is what the GPU benchmark calls; ctx = {"model_dir", "prompt_ids" (token-id
lists), "max_new_tokens", "device", "dtype", "num_generations"}. Every prompt is sampled
`num_generations` times; no row stops early (no stop token; vLLM with ignore_eos), so each
engine makes prompts x G x max_new_tokens tokens. Each returned row: {"name", "tokens_per_s",
"seconds", "tokens", ...}; a side that cannot run says why in "skipped".

Targets on one H100/H200, Qwen2.5-0.5B shape, 1024 new tokens (measured on a GPU machine, not
here): ours >= 30k tokens/s and >= 5x transformers' generate; our vllm engine >= 0.9x bare vLLM.

`python benchmarks/gpu_bench_generate.py --tiny`: a CPU self-test on a tiny model (prints the rows).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def compare(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    from rlhf_batch.models.load import load_model

    model = load_model(ctx["model_dir"], "policy", device=ctx["device"], dtype=ctx["dtype"])
    g = int(ctx["num_generations"])
    prompts = [list(p) for p in ctx["prompt_ids"] for _ in range(g)]
    rows = [ours(model, prompts, ctx), transformers_generate(model, prompts, ctx)]
    del model
    return rows + bare_vllm(ctx)


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def ours(model: Any, prompts: list[list[int]], ctx: dict[str, Any]) -> dict[str, Any]:
    """Our sampler as the hf engine runs it: longest prompts first, rows per batch from free
    memory (engines/hf.py `auto_rows`), halved on running out of memory."""
    from rlhf_batch.engines.hf import auto_rows
    from rlhf_batch.engines.sampler import sample

    order = sorted(range(len(prompts)), key=lambda r: (-len(prompts[r]), r))
    n_new, tokens, sizes = int(ctx["max_new_tokens"]), 0, []
    _sync(ctx["device"])
    t0 = time.perf_counter()
    start = 0
    while start < len(order):
        rows = order[start : start + auto_rows(model, len(prompts[order[start]]), n_new)]
        out = sample(model, [prompts[r] for r in rows], rows, max_new_tokens=n_new, pad_id=_pad(model))
        tokens += sum(len(t) for t, _, _ in out)
        sizes.append(len(rows))
        start += len(rows)
    _sync(ctx["device"])
    seconds = time.perf_counter() - t0
    return {
        "name": "ours (batch auto)",
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "batches": sizes,
    }


def _pad(model: Any) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0


def transformers_generate(model: Any, prompts: list[list[int]], ctx: dict[str, Any]) -> dict[str, Any]:
    """`model.generate(do_sample=True)` on left-padded batches of the rows ours decodes at once
    (halved on running out of memory), no stop token, log-probs of the sampled tokens kept."""
    import torch

    from rlhf_batch.engines.hf import auto_rows

    n_new, pad, tokens = int(ctx["max_new_tokens"]), _pad(model), 0
    size = auto_rows(model, max(len(p) for p in prompts), n_new)
    _sync(ctx["device"])
    t0 = time.perf_counter()
    start = 0
    while start < len(prompts):
        batch = prompts[start : start + size]
        try:
            tokens += _hf_batch(model, batch, n_new, pad)
        except torch.OutOfMemoryError:
            size = max(1, size // 2)
            torch.cuda.empty_cache()
            continue
        start += len(batch)
    _sync(ctx["device"])
    seconds = time.perf_counter() - t0
    return {
        "name": "transformers generate",
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "batch": size,
    }


def _hf_batch(model: Any, batch: list[list[int]], n_new: int, pad: int) -> int:
    import torch

    device = next(model.parameters()).device
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    with torch.no_grad():
        res = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
    gen = res.sequences[:, width:]  # [B, T]
    logits = torch.stack(res.logits, dim=1)  # [B, T, V]
    torch.log_softmax(logits.float(), -1).gather(-1, gen[..., None])  # the behaviour log-probs, as ours
    return int(gen.numel())


def bare_vllm(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """Bare vLLM (one request per prompt, n = G, ignore_eos) and our vllm engine's requests (one
    per rollout with its seed, stop ids, log-probs) on the same started engine."""
    try:
        import vllm
    except ImportError as e:
        return [
            {"name": n, "skipped": f"vllm is not importable ({e})"} for n in ("bare vllm", "our vllm engine")
        ]
    from rlhf_batch.config import load_config
    from rlhf_batch.engines.vllm import Engine, sample_rows

    n_new, g = int(ctx["max_new_tokens"]), int(ctx["num_generations"])
    cfg = load_config(
        None, [f"dtype={ctx['dtype']}", "generate.engine=vllm", f"generate.max_new_tokens={n_new}"]
    )
    engine = Engine(ctx["model_dir"], cfg)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in ctx["prompt_ids"]]
    params = vllm.SamplingParams(
        n=g, temperature=1.0, max_tokens=n_new, ignore_eos=True, logprobs=0, detokenize=False
    )
    engine.llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = engine.llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    rows = [{"name": "bare vllm", "tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}]
    rollouts = [list(p) for p in ctx["prompt_ids"] for _ in range(g)]
    t0 = time.perf_counter()
    res = sample_rows(engine, rollouts, list(range(len(rollouts))), cfg.generate, set())
    seconds = time.perf_counter() - t0
    tokens = sum(len(t) for t, _, _ in res)
    rows.append(
        {"name": "our vllm engine", "tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}
    )
    return rows


def tiny_ctx(root: Path) -> dict[str, Any]:
    """A tiny local model and a few prompts: the CPU self-test's ctx."""
    from rlhf_batch.models.tiny import init_model

    model = root / "policy"
    if not model.exists():
        init_model(model, arch="qwen2", seed=0)
    prompts = [[5 + (i * 7 + j) % 90 for j in range(3 + i % 5)] for i in range(6)]
    return {
        "model_dir": str(model),
        "prompt_ids": prompts,
        "max_new_tokens": 6,
        "device": "cpu",
        "dtype": "float32",
        "num_generations": 2,
    }


def main() -> None:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="CPU self-test on a tiny model")
    p.add_argument("--ctx", help="a JSON file holding compare's ctx")
    args = p.parse_args()
    if args.ctx:
        rows = compare(json.loads(Path(args.ctx).read_text()))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows = compare(tiny_ctx(Path(tmp)))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
