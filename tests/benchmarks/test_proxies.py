"""The GPU proxies of benchmarks/bench_proxies.py as counts (no times): kernel launches of the LM
head per response token on CUDA's path, host syncs per train micro-batch, and the entropy of a
step computed only where used or sampled for its metric. The counters are shown counting what
they must first, so the targets cannot pass for want of counting."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_proxies as bp  # noqa: E402


def test_the_counters_count_kernels_and_syncs() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    with bp.KernelOps() as ops:
        y = x.t().reshape(-1)  # a view of a transpose: one copy kernel (reshape of a non-contiguous)
        (y + 1).sum()  # add, sum
        torch.empty(4)  # an allocation: no kernel
    assert ops.n == 3, ops.by
    tolist = torch.Tensor.tolist
    with bp.HostSyncs() as syncs:
        x.sum().item()  # 1
        bool(x.max() > 2)  # 2
        x[x > 2]  # boolean indexing: 3
        x.tolist()  # 4
        x.index_select(0, torch.tensor([1]))  # none: indices from the host
    assert syncs.n == 4, syncs.by
    assert torch.Tensor.tolist is tolist  # put back on exit


@pytest.mark.parametrize("stage", ["score", "train"])
def test_lm_head_kernel_launches_per_token_meet_their_targets(stage: str) -> None:
    # 4096 response tokens at vocab 151,936 on the meta device; the passes of before (16 rows)
    # launch ~0.44 (score) / ~0.9 (train) per token, far above the targets
    now = bp.head_ops(stage, 4096)
    before = bp.head_ops(stage, 4096, before=True)
    assert now["per_token"] <= bp.TARGETS[stage] < before["per_token"], (now, before)
    if stage == "train":  # the entropy, when on, stays within the target too
        assert bp.head_ops(stage, 4096, entropy=True)["per_token"] <= bp.TARGETS[stage]


def test_a_train_micro_batch_syncs_the_host_at_most_once(tiny_model: Path) -> None:
    got = bp.train_syncs(tiny_model, micro=3)
    assert got["per_micro_batch"] <= 1, got
    # the step's own: the gradient norm, the metrics read once (and the sequences' log-weights)
    assert got["per_step"] <= 4, got


def test_entropy_is_computed_for_the_loss_or_sampled_from_the_first_micro_batch(tiny_model: Path) -> None:
    from rlhf_batch.stages.train.data import Step, micro_batch

    for coef in (0.0, 0.05):
        tr = bp.trainer(tiny_model, bp._rows(105, 6, np.random.default_rng(1)), coef)
        mbs = ((0, 1), (2, 3), (4, 5))
        # the oracle, from the model before the step: -sum p log p of the full logits per token
        ents, counts = [], []
        with torch.no_grad():
            for rows in mbs:
                td = micro_batch(tr.data, rows, "cpu")
                logits = tr.model(input_ids=td["input_ids"]).logits  # [B, L, V]
                lsm = torch.log_softmax(logits.float(), -1).flatten(0, 1).index_select(0, td["select"])
                ents.append(float(-(lsm.exp() * lsm).sum(-1).sum()))
                counts.append(len(td["select"]))
        calls: list[bool] = []
        real = tr.forward

        def forward(td, with_entropy=True, calls=calls, real=real):  # type: ignore[no-untyped-def]
            calls.append(with_entropy)
            return real(td, with_entropy)

        tr.forward = forward  # type: ignore[method-assign]
        row = tr.step(Step(0, 0, mbs, int(tr.data.resp_lens.sum()), 6, 0))
        if coef:  # in the loss: every micro-batch, the mean over all tokens
            assert calls == [True, True, True]
            assert row["entropy"] == pytest.approx(sum(ents) / sum(counts), rel=1e-5)
        else:  # for the metric only: the step's first micro-batch
            assert calls == [True, False, False]
            assert row["entropy"] == pytest.approx(ents[0] / counts[0], rel=1e-5)
