"""GPU efficiency proxies measured on a CPU: counts, not times.

- **Kernel launches per response token** of the LM head (`core.logprobs`) at vocab 151,936 and
  hidden 896 (Qwen2.5-0.5B), on the path CUDA takes: the ops run on the meta device (shapes
  only, no memory, no arithmetic), which sizes the float32 passes as any non-CPU device does
  (`pass_rows`, `default_chunk_size`). `KernelOps` counts the aten ops that launch a kernel
  (views, allocations and scalar reads do not). Score: forward in bf16, no entropy. Train:
  forward + backward from float32 master weights under bf16 autocast, without entropy (the
  default `entropy_coef` 0; the step's first micro-batch computes it for the metric) and with
  it. The baseline is the same code with the passes of before (16 rows, chunks of 512: the
  CPU's sizing that CUDA used to take). Targets: train <= 0.1, score <= 0.03.
- **Host syncs per train micro-batch**: a real `Trainer.step` of a tiny model on the CPU, under
  `HostSyncs`, which counts what would make the host wait for a GPU (reading a device value:
  `.item()`, `bool()`, `.tolist()`, `.numpy()`, `.cpu()`, nonzero, boolean indexing,
  `masked_select`, `unique`, `repeat_interleave` without an output size, `equal`). Per
  micro-batch: the difference between a step of K micro-batches and a step of one, / (K - 1);
  what remains is the step's own (the gradient norm, the metrics read once). Target <= 1.

`--tiny` counts at 4096 response tokens (the smoke test); the full run at 16384 (one micro-batch
of `train.max_tokens_per_batch` = 16384).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

VOCAB, HIDDEN = 151936, 896  # Qwen2.5-0.5B
TARGETS = {"train": 0.1, "score": 0.03, "syncs": 1.0}
# aten ops that launch no kernel: allocations, aliasing, metadata, scalar reads (views are
# recognised by their schema: OpOverload.is_view)
NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "_unsafe_view",
    "_reshape_alias",
    "_local_scalar_dense",
    "resize_",
    "set_",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
}
# aten ops whose result size or value the host needs before it goes on (a device sync on CUDA)
SYNC_OPS = {
    "_local_scalar_dense",  # .item(), bool(), int(), float()
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "allclose",
}


def _dispatch_mode() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def launches_kernel(func: Any) -> bool:
    """Whether the aten op `func` launches a kernel (on CUDA: one launch, or a few for a
    fused op; counted as one)."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL


def syncs_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the aten op `func` on CUDA tensors makes the host wait for the device."""
    import torch

    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # boolean-mask indexing
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) < 2:
        return kwargs.get("output_size") is None  # repeats as a tensor: the output's size
    return False


class KernelOps(_dispatch_mode()):  # type: ignore[misc]
    """Counts the aten ops that launch a kernel while active: `n`, and by name in `by`."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.by: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if launches_kernel(func):
            self.n += 1
            self.by[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)


class HostSyncs(_dispatch_mode()):  # type: ignore[misc]
    """Counts host syncs while active (`n`, by name in `by`): the aten ops of `syncs_host`, and
    the reads of a tensor's values by the host that reach no aten op on a CPU (`Tensor.tolist`,
    `numpy`, `cpu`), patched for the duration."""

    READS = ("tolist", "numpy", "cpu")

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.by: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    def _count(self, name: str) -> None:
        self.n += 1
        self.by[name] += 1

    def __enter__(self) -> HostSyncs:
        import torch

        for name in self.READS:
            real = self._saved[name] = getattr(torch.Tensor, name)

            def read(t: Any, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
                self._count(_name)
                return _real(t, *a, **k)

            setattr(torch.Tensor, name, read)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        import torch

        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)  # type: ignore[no-any-return]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if syncs_host(func, args, kwargs):
            self._count(func.overloadpacket.__name__)
        return func(*args, **kwargs)


# ---------------------------------------------------------------- kernel launches of the LM head


@contextlib.contextmanager
def _passes_of_before() -> Iterator[None]:
    """The LM head's passes as CUDA ran them before they were sized by bytes: 16 rows (a large
    vocabulary), backward blocks of GRAD_BLOCK_BYTES."""
    from rlhf_batch.core import logprobs

    saved = logprobs.DEVICE_PASS_BYTES
    logprobs.DEVICE_PASS_BYTES = 0
    try:
        yield
    finally:
        logprobs.DEVICE_PASS_BYTES = saved


def head_ops(stage: str, tokens: int, entropy: bool = False, before: bool = False) -> dict[str, Any]:
    """Kernel launches per response token of the LM head over `tokens` response positions of one
    micro-batch, on the meta device (the path of any non-CPU device). `stage`: "score" (forward,
    bf16 weights, no gradient) or "train" (forward + backward, float32 weights, bf16 head)."""
    import torch

    from rlhf_batch.core import logprobs
    from rlhf_batch.models.forward import default_chunk_size

    dev, bf16 = "meta", torch.bfloat16
    train = stage == "train"
    hidden = torch.empty(tokens, HIDDEN, device=dev, dtype=bf16, requires_grad=train)
    weight = torch.empty(
        VOCAB, HIDDEN, device=dev, dtype=torch.float32 if train else bf16, requires_grad=train
    )
    targets = torch.zeros(tokens, dtype=torch.long, device=dev)
    with _passes_of_before() if before else contextlib.nullcontext():
        chunk = 512 if before else default_chunk_size(VOCAB, True, dev)
        # as linear_logprobs calls it, in bf16 (train: under bf16 autocast; autocast has no meta device)
        args = (hidden, weight, None, targets, 1.0, chunk, entropy, bf16, logprobs.GRAD_BLOCK_BYTES)
        with KernelOps() as ops:
            if train:
                lp, _ = logprobs._LinearLogprobs.apply(*args)
                lp.backward(torch.ones_like(lp))
            else:
                with torch.inference_mode():
                    logprobs._LinearLogprobs.apply(*args)
    return {"per_token": ops.n / tokens, "ops": ops.n, "chunk": chunk, "by": dict(ops.by.most_common(6))}


# ---------------------------------------------------------------- host syncs of a train step


def _rows(vocab: int, n: int, rng: np.random.Generator) -> Any:
    """Synthetic advantages rows (prompts of 3..8 tokens, responses of 4..20) as TrainRows."""
    from rlhf_batch.stages.train.data import TrainRows, _offsets

    plen, resp = rng.integers(3, 9, n), rng.integers(4, 21, n)  # [N]
    seq = plen + resp
    return TrainRows(
        rollout_ids=[f"r{i}" for i in range(n)],
        ids=rng.integers(0, vocab, int(seq.sum())),
        ids_off=_offsets(seq),
        prompt_lens=plen.astype(np.int64),
        old=(-rng.random(int(resp.sum())) * 3).astype(np.float32),
        ref=None,
        resp_off=_offsets(resp),
        adv=rng.standard_normal(n).astype(np.float32),
    )


def trainer(model_dir: Path, rows: Any, entropy_coef: float = 0.0) -> Any:
    """A single-rank Trainer of the model at `model_dir` over `rows`, float32 on the CPU, wired
    as train.build_trainer wires it (fused AdamW, the loss's keyword arguments)."""
    import torch

    from rlhf_batch.config import TrainConfig
    from rlhf_batch.models.load import load_model
    from rlhf_batch.stages.train.step import LogProbs, Trainer

    model = load_model(str(model_dir), "policy", device="cpu", dtype="float32")
    model.train()
    tc = TrainConfig(entropy_coef=entropy_coef)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    kwargs = dict(eps_low=0.2, eps_high=0.2, dual_clip=None, aggregation="token_mean", kl_coef=0.0)
    kwargs |= dict(entropy_coef=entropy_coef, norm_const=None, kl_to_inference_coef=0.0, tis_cap=0.0)
    return Trainer(model, LogProbs(model, 1.0, 0), opt, rows, tc, kwargs, 1, "cpu", 1, 0, False, None)


def step_syncs(tr: Any, micro: int) -> tuple[int, dict[str, int]]:
    """Host syncs of one optimizer step over the first rows of `tr.data`, cut into `micro`
    micro-batches of 2 rows."""
    from rlhf_batch.stages.train.data import Step

    mbs = tuple((2 * k, 2 * k + 1) for k in range(micro))
    rows = [i for mb in mbs for i in mb]
    step = Step(0, 0, mbs, int(tr.data.resp_lens[rows].sum()), len(rows), rows[0])
    with HostSyncs() as syncs:
        tr.step(step)
    return syncs.n, dict(syncs.by)


def train_syncs(model_dir: Path, micro: int = 4, entropy_coef: float = 0.0) -> dict[str, Any]:
    """Host syncs per train micro-batch and per step (module docstring)."""
    tr = trainer(model_dir, _rows(105, 2 * micro, np.random.default_rng(0)), entropy_coef)
    one, _ = step_syncs(tr, 1)
    many, by = step_syncs(tr, micro)
    per_mb = (many - one) / (micro - 1)
    return {"per_micro_batch": per_mb, "per_step": one - per_mb, "by": by, "micro": micro}


# ---------------------------------------------------------------- the rows


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    from rlhf_batch.models.tiny import init_model

    tokens = 4096 if args.tiny else 16384
    load = common.loadavg()
    work = f"vocab {VOCAB:,} x hidden {HIDDEN}, {tokens} response tokens in one micro-batch; meta device (CUDA's path)"
    for stage, entropy, what in (
        ("score", False, "score LM head"),
        ("train", False, "train LM head"),
        ("train", True, "train LM head, entropy on"),
    ):
        now, before = head_ops(stage, tokens, entropy), head_ops(stage, tokens, entropy, before=True)
        target = TARGETS[stage]
        common.append_row(
            args.results,
            f"{what}: kernel launches",
            f"{work}; chunk {now['chunk']} rows (before: {before['chunk']}); load {load}",
            "aten ops launching a kernel per response token",
            f"{now['per_token']:.4f} ({now['ops']} ops)",
            f"{before['per_token']:.3f} ({before['ops']} ops)",
            f"{before['per_token'] / now['per_token']:.0f}x fewer",
            target=f"<= {target}",
            met=now["per_token"] <= target,
        )
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "policy", arch="qwen2", seed=0)
        got = train_syncs(model, micro=4)
    common.append_row(
        args.results,
        "train host syncs",
        f"tiny qwen2 on the CPU, float32, steps of 1 and {got['micro']} micro-batches; step's own: "
        f"{got['per_step']:.0f} ({', '.join(f'{k} {v}' for k, v in sorted(got['by'].items()))})",
        "host syncs per train micro-batch",
        f"{got['per_micro_batch']:.2f}",
        target="<= 1",
        met=got["per_micro_batch"] <= TARGETS["syncs"],
    )


if __name__ == "__main__":
    main()
