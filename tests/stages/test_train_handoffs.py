"""What train's loss receives: the tensors `grpo_loss` is called with, captured in a real run of
multi-turn rollouts (the tiny model, an environment that inserts a tool message), checked row by
row against the advantages files read back with pyarrow."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_batch.stages.registry import run_stage
from rlhf_batch.stages.train import step as train_step
from rlhf_batch.store import layout, manifests

ENV = '[generate]\nenvironment = "tests.stages.test_multiturn:answer_once"\nmax_turns = 2\n'


@pytest.mark.slow
def test_the_loss_mask_reaching_grpo_loss_is_each_rows_loss_mask(make_config, monkeypatch) -> None:
    _, cfg = make_config(ENV, train={"lr": 1e-3, "max_tokens_per_batch": 64})
    for name in ("generate", "score", "advantage"):
        run_stage(name, cfg, 0, quiet=True)
    adv = pa.concat_tables(
        pq.read_table(layout.folder(cfg.run_dir, 0, "advantages") / p["file"])
        for p in manifests.manifest(layout.folder(cfg.run_dir, 0, "advantages"))["parts"]
    )
    by_id = {
        r["rollout_id"]: r for r in adv.select(["rollout_id", "loss_mask", "behavior_logprobs"]).to_pylist()
    }

    last: list[list[str]] = []  # the rollout ids of the latest micro-batch
    calls: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []  # (ids, mask, old) per loss call
    real_batch, real_loss = train_step.micro_batch, train_step.grpo_loss

    def micro_batch(data, rows, device):  # noqa: ANN001, ANN202
        last[:] = [[data.rollout_ids[i] for i in rows]]
        return real_batch(data, rows, device)

    def grpo_loss(logp, old, advantages, mask, **kw):  # noqa: ANN001, ANN202
        calls.append((last[0], mask.clone(), old.clone()))
        return real_loss(logp, old, advantages, mask, **kw)

    monkeypatch.setattr(train_step, "micro_batch", micro_batch)
    monkeypatch.setattr(train_step, "grpo_loss", grpo_loss)
    run_stage("train", cfg, 0, quiet=True)

    seen, environment_tokens = [], 0
    for ids, mask, old in calls:
        assert mask.dtype == torch.bool and mask.shape[0] == len(ids)  # [B, T]
        for k, rid in enumerate(ids):
            want = [bool(m) for m in by_id[rid]["loss_mask"]]
            # the row's own loss mask on its response tokens, then padding (False) to width T
            assert mask[k].tolist() == want + [False] * (mask.shape[1] - len(want)), rid
            # where it is 0 the environment wrote the token: the behaviour log-prob there is 0
            assert all(o == 0.0 for o, m in zip(old[k].tolist(), want, strict=False) if not m), rid
            environment_tokens += want.count(False)
            seen.append(rid)
    assert sorted(seen) == sorted(by_id)  # every row reached the loss once (one epoch)
    assert environment_tokens > 0  # the rows do hold environment tokens
