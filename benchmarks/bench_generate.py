"""generate: sampling with behaviour log-probs, ours against Hugging Face `generate`.

Both sample from the full softmax at temperature 1 (no top-k / top-p) and record the behaviour
log-prob of every sampled token. Response lengths follow the workload's skewed distribution:
a random model almost never samples EOS, so each row gets its length as a per-row budget
(ours: `sampler.sample(max_new_tokens=[...])`; Hugging Face: a per-row StoppingCriteria,
which marks a row finished exactly as an EOS would). Both produce the same useful tokens.

Ours: the generate stage's batching (rows sorted by prompt length, longest first, batches of
`generate.batch_size`), `rlhf_batch.sampler.sample`: left-padded prefill, KV cache, finished
rows leave the batch and the cache. Baseline: `model.generate(do_sample=True, top_k=0,
output_logits=True)` on padded batches of 32 rows in input order, then log_softmax of the
returned logits at the sampled tokens (what a competent engineer writes first with HF).
Both run on the first 64 rows of the workload with responses capped at 256 tokens (same skewed
shape: 70% of 4..32, 20% of 33..128, 10% of 129..256), to keep `make bench` short: a decode
step of the 50M model costs ~0.1-0.3 s here, and a padded batch runs as many steps as its
longest row.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Mem, Workload, append_row, emit, make_workload, mb, model_dir  # noqa: E402

CAP = 256  # longest response: every decode step of a 50M model costs ~0.1-0.3 s on this machine


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
    """The generate stage's batching around rlhf_batch.sampler.sample."""
    from rlhf_batch.sampler import sample

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


def behaviour_error(model: Any, w: Workload, out: list[tuple[list[int], list[float]]], rows: int) -> float:
    """max |recorded log-prob - one forward pass| over the first `rows` rows."""
    import torch

    from rlhf_batch.forward import response_logprobs

    worst = 0.0
    with torch.inference_mode():
        for i in range(min(rows, len(out))):
            logp, _, _ = response_logprobs(
                model, [w.prompt_ids[i] + out[i][0]], [len(w.prompt_ids[i])], 1.0, pad_id=1
            )
            worst = max(worst, float((logp[0] - torch.tensor(out[i][1])).abs().max()))
    return worst


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rlhf_batch.models import load_model

    torch.manual_seed(0)
    w = make_workload(spec["rows"], spec["vocab"], tiny=spec["tiny"], cap=CAP).head(spec["take"])
    mem = Mem()
    model = load_model(spec["model"], "policy", device="cpu", dtype="float32")
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
        "behaviour_err": behaviour_error(model, w, out, 4),
    }


WORKERS = {"run": worker}


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
        f"{common.lengths_text(w)}; ours batch_size {best} ({others}); behaviour log-prob vs forward "
        f"max err ours {o['behaviour_err']:.1e}, HF {hf['behaviour_err']:.1e}",
        "sampled tokens/s",
        f"{tps:.0f}",
        f"{tps_hf:.0f}",
        f"{tps / tps_hf:.1f}x",
        mem=f"{mb(o['peak_above'])} / {mb(hf['peak_above'])}",
        target=">= 2x",
        met=tps / tps_hf >= 2,
    )


if __name__ == "__main__":
    main()
