"""The measurements of benchmarks/gpu_check.py that need torch in its own process: the device's bf16
matmul peak, the model's matmul parameters, and the numerics of a small slice of the run against
CPU float32 (log-probs as score computes them, the GRPO loss as train computes it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# Tolerances of the bf16 path against CPU float32 on the slice (a random model's log-probs are
# ~ -log(vocab); bf16 weights round each logit by ~2^-8 of its size).
TOL = {"logprob_mean": 0.05, "logprob_max": 1.0, "loss_abs": 0.05}


def matmul_peak(device: str, n: int) -> float:
    """Best TFLOP/s of an n x n x n bf16 matmul through F.linear (nn.Linear's path) on `device`."""
    import torch
    import torch.nn.functional as F

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for reps in (2, 10, 10, 10):  # the first round warms up
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            F.linear(a, b)
        sync()
        best = min(best, (time.perf_counter() - t0) / reps) if reps > 2 else best
    return 2 * n**3 / best / 1e12


def flop_params(model_dir: Path) -> tuple[int, int]:
    """(decoder matmul parameters, LM-head parameters) of a model, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    return body - (head if "lm_head.weight" in dict(model.named_parameters()) else 0), head


def compare(policy: Path, advantages: Path, device: str, rows: int, temperature: float) -> dict[str, Any]:
    """Log-probs of `rows` training rows (iteration 0's advantages) as score computes them (bf16
    weights on `device`) and the loss as train computes it (float32 weights, bf16 autocast on
    `device`), each against CPU float32; also generate's behaviour log-probs against CPU float32."""
    import torch

    from rlhf_batch.models.forward import response_logprobs
    from rlhf_batch.models.load import load_model, load_tokenizer
    from rlhf_batch.store.manifests import read_complete
    from rlhf_batch.store.schemas import ADVANTAGES

    t = read_complete(advantages, ADVANTAGES).slice(0, rows).to_pylist()
    seqs, plens = [r["input_ids"] for r in t], [r["prompt_len"] for r in t]
    pad = load_tokenizer(str(policy)).pad_token_id

    def logp(model: Any, autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        dev = next(model.parameters()).device
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            lp, mask, _ = response_logprobs(model, seqs, plens, temperature, pad_id=pad)
        return lp.float().cpu(), mask.cpu()

    ref, mask = logp(load_model(str(policy), "policy", device="cpu", dtype="float32"))
    score_lp, _ = logp(load_model(str(policy), "policy", device=device, dtype="bfloat16"))
    train_lp, _ = logp(load_model(str(policy), "policy", device=device, dtype="float32"), autocast=True)
    behaviour = torch.zeros_like(ref).masked_scatter(
        mask, torch.cat([torch.tensor(r["behavior_logprobs"]) for r in t])
    )
    adv = torch.tensor([r["advantage"] for r in t], dtype=torch.float32)
    out = {"rows": rows, "tokens": int(mask.sum())}
    for name, lp in (
        ("score_bf16", score_lp),
        ("train_autocast", train_lp),
        ("generate_behaviour", behaviour),
    ):
        d = (lp - ref).abs()[mask]
        out[f"{name}_logprob_mean_abs"], out[f"{name}_logprob_max_abs"] = float(d.mean()), float(d.max())
    out["loss_cpu_fp32"], out["loss_device"] = (
        _loss(ref, behaviour, adv, mask),
        _loss(train_lp, behaviour, adv, mask),
    )
    return out


def _loss(lp: Any, old: Any, adv: Any, mask: Any) -> float:
    from rlhf_batch.core.losses import grpo_loss

    return float(grpo_loss(lp, old, adv, mask, eps_low=0.2).loss)


def failures(n: dict[str, Any]) -> list[str]:
    """The numerics checks that fail their tolerance (TOL), as lines."""
    out = []
    for name in ("score_bf16", "train_autocast"):
        for stat, key in (("mean", "logprob_mean"), ("max", "logprob_max")):
            v = n[f"{name}_logprob_{stat}_abs"]
            if not v <= TOL[key]:
                out.append(
                    f"numerics: {name} log-probs differ from CPU float32 by {v:.3g} ({stat}; > {TOL[key]})"
                )
    gap = abs(n["loss_device"] - n["loss_cpu_fp32"])
    if not gap <= TOL["loss_abs"]:
        out.append(
            f"numerics: loss {n['loss_device']:.5g} on the device vs {n['loss_cpu_fp32']:.5g} on CPU float32"
        )
    return out
