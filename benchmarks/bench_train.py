"""train: GRPO steps of the train stage against a naive training loop.

Data: the workload's rollouts (bench_score.write_rollouts), a scores stage with random rewards,
then the real advantage stage (length-bucketed parts) and the real train stage
(`run_stage("train", ...)`, one PPO epoch, default token budgets: 65536 response tokens per step, micro-
batches of <= 16384 padded tokens, float32 master weights, bf16 autocast only where the CPU
has bf16 units, which this one has not). The figure is the time of the optimizer steps (sum
over the metrics rows), the stage's wall time (with model load and save) is given too.
Baseline (what a competent engineer writes first): fixed batches of 16 rows in the advantage
stage's row order, right-padded to the longest, float32, full logits + log_softmax over the
vocabulary at every position, `core.losses.grpo_loss`, backward, one AdamW step at the end.

MFU = 6 x decoder matmul params x real tokens + 6 x LM-head params x response tokens, per
second, over the F.linear matmul peak of the same run (bf16 as asked; float32, the dtype used).
Padding = 1 - real tokens / (rows x longest row) summed over the micro-batches of the plan.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from bench_score import write_rollouts  # noqa: E402
from common import Mem, Workload, append_row, emit, make_workload, mb, model_dir  # noqa: E402

from rlhf_batch.stages.registry import run_stage


def write_scores(run_dir: Path, w: Workload) -> None:
    import numpy as np
    import pyarrow as pa

    from rlhf_batch.store import layout, output
    from rlhf_batch.store.schemas import SCORES

    n = len(w)
    reward = np.random.default_rng(1).random(n)
    cols = {
        "rollout_id": [f"0000-p{i // common.GROUP}-{i % common.GROUP}" for i in range(n)],
        "prompt_id": [f"p{i // common.GROUP}" for i in range(n)],
        "reward_raw": reward,
        "score": reward,
        "reward": reward,
        "ref_logprobs": [[-10.2] * len(r) for r in w.response_ids],
        "kl": [[0.2] * len(r) for r in w.response_ids],
        "kl_sum": [0.2 * len(r) for r in w.response_ids],
        "kl_coef": [0.0] * n,
    }
    table = pa.table({f.name: pa.array(cols[f.name], f.type) for f in SCORES}, schema=SCORES)
    stage = output.claim(layout.folder(run_dir, 0, "scores"), "scores", {"bench": True}, {}, True)
    stage.write_table(0, table, SCORES)
    stage.finish(1)


LORA = ["lora.enabled=true", "lora.r=16", "lora.alpha=32", 'lora.target_modules=["all-linear"]']


def prepare(run_dir: Path, w: Workload, model: str, lora: bool = False) -> Any:
    from rlhf_batch.config import load_config

    write_rollouts(run_dir, w)
    write_scores(run_dir, w)
    keys = [f"run_dir={run_dir}", f"policy_model={model}", "device=cpu", "dtype=auto", "train.lr=1e-6"]
    cfg = load_config(None, keys + (LORA if lora else []))
    run_stage("advantage", cfg, 0, quiet=True)
    return cfg


def padding(cfg: Any) -> tuple[float, int]:
    """Share of padding in the micro-batches the train stage plans, and their count."""
    from rlhf_batch.stages.train.data import load_rows, plan_steps
    from rlhf_batch.store import layout

    data = load_rows(layout.folder(cfg.run_dir, 0, "advantages"))
    t = cfg.train
    steps = plan_steps(
        data.resp_lens, data.seq_lens, t.tokens_per_step, t.max_tokens_per_batch, 1, (0, 0), t.max_padding
    )
    micro = [list(mb) for s in steps for mb in s.micro]
    padded = sum(len(mb) * int(data.seq_lens[mb].max()) for mb in micro)
    return 1 - int(data.seq_lens.sum()) / padded, len(micro)


def worker_stage(spec: dict[str, Any]) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from rlhf_batch.runtime.device import setup_process
    from rlhf_batch.store import layout

    setup_process(0)  # as the stage command does (torch's threads as they are)
    w = make_workload(spec["rows"], spec["vocab"], tiny=spec["tiny"]).head(spec["take"])
    with tempfile.TemporaryDirectory(dir=common.CACHE) as tmp:
        cfg = prepare(Path(tmp) / "run", w, spec["model"], spec.get("lora", False))
        pad, n_micro = padding(cfg)
        mem = Mem()
        t0 = time.perf_counter()
        run_stage("train", cfg, 0, quiet=True)
        wall = time.perf_counter() - t0
        m = pq.read_table(layout.folder(cfg.run_dir, 0, "train") / "metrics.parquet").to_pylist()
        trainable = trained_parameters(layout.policy_dir(cfg.run_dir, 0), cfg.lora.enabled)
    steps = sum(r["tokens"] / r["tokens_per_s"] for r in m)
    return {
        "seconds": steps,
        "wall": wall,
        "tokens": w.tokens,
        "response_tokens": w.response_tokens,
        "padding": pad,
        "micro": n_micro,
        "steps": len(m),
        "peak_rss": mem.peak_above() + mem.base,
        "trainable": trainable,
    }


def trained_parameters(policy: Path, lora: bool) -> int:
    """Parameters the stage trained: those of the saved adapter with LoRA, else of the whole model."""
    from safetensors import safe_open

    from rlhf_batch.store import layout

    path = policy / layout.ADAPTER_DIR / "adapter_model.safetensors" if lora else policy / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def naive_train(model: Any, w: Workload, adv: list[float], batch: int = 16) -> None:
    """THE BASELINE: fixed padded batches in order, full-vocab log_softmax, GRPO loss, AdamW."""
    import torch

    from rlhf_batch.core.losses import grpo_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    total = w.response_tokens
    for s in range(0, len(w), batch):
        p_lens = [len(p) for p in w.prompt_ids[s : s + batch]]
        seqs = [
            p + r for p, r in zip(w.prompt_ids[s : s + batch], w.response_ids[s : s + batch], strict=True)
        ]
        width, t_max = max(len(q) for q in seqs), max(len(q) - p for q, p in zip(seqs, p_lens, strict=True))
        ids = torch.ones((len(seqs), width), dtype=torch.long)  # [B, L]
        attn = torch.zeros_like(ids)  # [B, L]
        idx = torch.zeros((len(seqs), t_max), dtype=torch.long)  # [B, T] positions predicting responses
        mask = torch.zeros((len(seqs), t_max), dtype=torch.bool)  # [B, T]
        for i, q in enumerate(seqs):
            ids[i, : len(q)], attn[i, : len(q)] = torch.tensor(q), 1
            r = len(q) - p_lens[i]
            idx[i, :r], mask[i, :r] = torch.arange(p_lens[i] - 1, len(q) - 1), True
        logits = model(input_ids=ids, attention_mask=attn).logits  # [B, L, V]
        logp_all = torch.log_softmax(logits.float(), dim=-1)  # [B, L, V]
        tok = logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
        logp = tok.gather(1, idx.clamp(max=width - 2))  # [B, T]
        old = torch.full_like(logp, -10.0)  # [B, T]
        out = grpo_loss(
            logp,
            old,
            torch.tensor(adv[s : s + batch]),
            mask,
            ref_logprobs=old - 0.2,
            denominator=float(total),
        )
        out.loss.backward()
    opt.step()


def worker_naive(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from rlhf_batch.models.load import load_model

    w = make_workload(spec["rows"], spec["vocab"], tiny=spec["tiny"]).head(spec["take"])
    model = load_model(spec["model"], "policy", device="cpu", dtype="float32").train()
    body, head = common.flop_params(model)
    mem = Mem()
    mem.mark()
    t0 = time.perf_counter()
    naive_train(model, w, np.random.default_rng(0).normal(size=len(w)).tolist())
    seconds = time.perf_counter() - t0
    from rlhf_batch.runtime.device import resolve_dtype

    return {
        "ceiling": common.shape_ceiling(model, resolve_dtype("auto", "cpu")),
        "seconds": seconds,
        "tokens": w.tokens,
        "response_tokens": w.response_tokens,
        "body": body,
        "head": head,
        "peak_above": mem.peak_above(),
    }


WORKERS = {"stage": worker_stage, "naive": worker_naive}


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    if args.worker:
        emit(WORKERS[args.worker](json.loads(args.spec)))
        return
    tiny = args.tiny
    peaks = common.peaks_from(args)
    common.CACHE.mkdir(parents=True, exist_ok=True)
    base = {"model": str(model_dir(tiny)), "vocab": 105 if tiny else 32000, "tiny": tiny, "rows": 512}
    sizes = [16] if tiny else [16, 32, 64]
    runs = [common.run_worker("bench_train.py", "stage", {**base, "take": k}) for k in sizes]
    naive = common.run_worker("bench_train.py", "naive", {**base, "take": 16})
    ours, body, head = runs[-1], naive["body"], naive["head"]
    tps, tps_n = ours["tokens"] / ours["seconds"], naive["tokens"] / naive["seconds"]
    w = make_workload(512, base["vocab"], tiny=tiny).head(sizes[-1])
    append_row(
        args.results,
        "train tokens/s",
        f"{common.lengths_text(w)}; {ours['steps']} optimizer step(s), {ours['micro']} micro-batches, "
        f"stage wall {ours['wall']:.0f}s; baseline on the first 16 rows",
        "real tokens/s (fwd+bwd+AdamW)",
        f"{tps:.0f}",
        f"{tps_n:.0f}",
        f"{tps / tps_n:.1f}x",
        mem=f"{mb(ours['peak_rss'])} (whole process) / {mb(naive['peak_above'])} (above model)",
    )
    from rlhf_batch.runtime.device import resolve_dtype

    dtype = str(resolve_dtype("auto", "cpu"))
    common.append_mfu_row(
        args.results,
        "train MFU",
        f"as above, compute in {dtype} (float32 master weights, bf16 autocast where dtype auto is bf16); "
        "executed = LM head at response positions only",
        6,
        {**ours, "executed_tokens": ours["tokens"]},
        naive,
        (body, head),
        peaks,
        dtype,
        0.35,
        naive["ceiling"],
    )
    append_row(
        args.results,
        "train padding",
        "micro-batches planned by the train stage",
        "padding share of tokens",
        f"{ours['padding']:.1%}",
        target="<= 10%",
        met=ours["padding"] <= 0.10,
    )
    lora_row(args.results, base, sizes[-1], ours, w)
    if len(runs) > 1:
        expo = common.fit_exponent([r["tokens"] for r in runs], [r["seconds"] for r in runs])
        times = ", ".join(f"{r['seconds']:.1f}s" for r in runs)
        append_row(
            args.results,
            "train scaling",
            f"{sizes} rollouts = {[r['tokens'] for r in runs]} tokens",
            "fitted exponent of time vs tokens",
            f"{expo:.2f} (times {times})",
            target="<= 1.1",
            met=expo <= 1.1,
        )


def lora_row(results: Path, base: dict[str, Any], take: int, full: dict[str, Any], w: Workload) -> None:
    """LoRA (r 16, alpha 32, all-linear) beside full training: same rows, same stage, same step plan."""
    lora = common.run_worker("bench_train.py", "stage", {**base, "take": take, "lora": True})
    tps, tps_full = lora["tokens"] / lora["seconds"], full["tokens"] / full["seconds"]
    what = f"{common.lengths_text(w)}; train stage, LoRA r 16 all-linear vs full weights (baseline)"
    mem = f"{mb(lora['peak_rss'])} / {mb(full['peak_rss'])} (whole process)"
    append_row(results, "train LoRA tokens/s", what, "real tokens/s", f"{tps:.0f}", f"{tps_full:.0f}",
               f"{tps / tps_full:.2f}x", mem=mem)  # fmt: skip
    append_row(results, "train LoRA trainable parameters", what, "parameters updated",
               f"{lora['trainable']:,}", f"{full['trainable']:,}", f"{lora['trainable'] / full['trainable']:.2%}",
               mem=mem)  # fmt: skip


if __name__ == "__main__":
    main()
