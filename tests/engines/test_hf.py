"""The hf engine's rows per batch: generate.batch_size = "auto" from a memory budget (the
formula of docs/configuration.md, worked out by hand below), and a batch that runs out of memory
split in halves; the rows come out the same as from one batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_batch.engines.hf import MEMORY_ENV, HFEngine, auto_rows, row_bytes
from rlhf_batch.errors import StageError
from rlhf_batch.models.load import load_tokenizer

PROMPTS = [[5 + (i + j) % 50 for j in range(10)] for i in range(12)]  # 12 rows of 10 tokens
SEEDS = list(range(40, 52))


class Bar:
    def update(self, n: int) -> None: ...

    def set_postfix(self, **kw: object) -> None: ...


def engine(make_config, monkeypatch, **generate: object) -> tuple[HFEngine, list[int]]:  # noqa: ANN001
    """The engine of a tiny run with `generate` settings; the sizes of the batches it decodes."""
    path, cfg = make_config(generate={"max_new_tokens": 6, **generate})
    tok = load_tokenizer(cfg.policy_model, False)
    eng = HFEngine(cfg, cfg.policy_model, tok, SimpleNamespace(tokens=PROMPTS))
    sizes: list[int] = []
    real = eng.sample_batch

    def spy(prompts, seeds):  # noqa: ANN001, ANN202
        sizes.append(len(prompts))
        return real(prompts, seeds)

    monkeypatch.setattr(eng, "sample_batch", spy)
    return eng, sizes


def test_row_bytes_of_the_tiny_model_by_hand(make_config, monkeypatch) -> None:  # noqa: ANN001
    eng, _ = engine(make_config, monkeypatch, batch_size="auto")
    c = (
        eng.model.config
    )  # 2 layers, 2 KV heads of 64 / 4 = 16, hidden 64, intermediate 128, vocab 105, float32
    assert (c.num_hidden_layers, c.num_key_value_heads, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        2, 2, 64, 128, 105,
    )  # fmt: skip
    # cache 2 * 2 * 2 * 16 * (10 + 6) * 4 = 8192; prefill 10 * (128 + 4 * 64) * 4 = 15360; logits 8 * 105 * 4 = 3360
    assert row_bytes(eng.model, 10, 6) == 8192 + 15360 + 3360
    monkeypatch.setenv(MEMORY_ENV, "90000")  # 0.9 * 90000 = 81000 bytes: 81000 // 26912 = 3 rows
    assert auto_rows(eng.model, 10, 6) == 3
    monkeypatch.delenv(MEMORY_ENV)
    assert auto_rows(eng.model, 10, 6) == 64  # on a CPU without a budget: the old default
    monkeypatch.setenv(MEMORY_ENV, "lots")
    with pytest.raises(Exception, match=MEMORY_ENV):
        auto_rows(eng.model, 10, 6)


def test_auto_batches_fit_the_budget_and_give_the_same_rows(make_config, monkeypatch) -> None:  # noqa: ANN001
    whole, sizes = engine(make_config, monkeypatch, batch_size=16)
    ref = whole.sample(PROMPTS, SEEDS, Bar())
    assert sizes == [12]
    monkeypatch.setenv(MEMORY_ENV, "90000")  # 3 rows a batch (previous test)
    auto, sizes = engine(make_config, monkeypatch, batch_size="auto")
    out = auto.sample(PROMPTS, SEEDS, Bar())
    assert sizes == [3, 3, 3, 3]
    assert [r[0] for r in out] == [r[0] for r in ref]
    assert (
        max(abs(a - b) for x, y in zip(out, ref, strict=True) for a, b in zip(x[1], y[1], strict=True)) < 1e-5
    )


def test_a_batch_that_runs_out_of_memory_is_halved(make_config, monkeypatch) -> None:  # noqa: ANN001
    whole, _ = engine(make_config, monkeypatch, batch_size=12)
    ref = whole.sample(PROMPTS, SEEDS, Bar())
    eng, sizes = engine(make_config, monkeypatch, batch_size=12)
    fits = eng.sample_batch

    def small_device(prompts, seeds):  # noqa: ANN001, ANN202 - a device that holds 4 rows
        if len(prompts) > 4:
            sizes.append(-len(prompts))
            raise torch.OutOfMemoryError("out of memory")
        return fits(prompts, seeds)

    monkeypatch.setattr(eng, "sample_batch", small_device)
    out = eng.sample(PROMPTS, SEEDS, Bar())
    assert sizes == [-12, -6, 3, 3, 3, 3]  # 12 and 6 refused, then halves of 3
    assert [r[0] for r in out] == [r[0] for r in ref]
    monkeypatch.setattr(
        eng, "sample_batch", lambda p, s: (_ for _ in ()).throw(torch.OutOfMemoryError("oom"))
    )
    with pytest.raises(StageError, match="does not fit in the device's memory"):
        eng.sample(PROMPTS[:1], SEEDS[:1], Bar())


def test_auto_on_a_cpu_keeps_the_identity_of_batch_size_64(make_config) -> None:  # noqa: ANN001
    """Folders written before "auto" (default 64) are not refused: on a CPU "auto" is recorded as
    64, and seed_per_rollout only when off."""
    _, cfg = make_config(generate={"batch_size": "auto"})
    ident = cfg.identity("generate")["generate"]
    assert ident["batch_size"] == 64 and "seed_per_rollout" not in ident
    _, cfg = make_config(generate={"batch_size": "auto", "engine": "vllm", "seed_per_rollout": False})
    assert cfg.identity("generate")["generate"]["seed_per_rollout"] is False
