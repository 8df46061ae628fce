"""The sampler's static decode path (engines/static_decode.py) against the dynamic one and
against plain forward passes; its rows independent of the batch; no host read inside its loop."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rlhf_batch.engines import static_decode
from rlhf_batch.engines.sampler import sample
from tests.stages.cli_helpers import unpadded_logprobs

ROWS = 64
OPTS = {"stop_ids": {0}, "pad_id": 1, "banned_ids": {1}}


@pytest.fixture(scope="module")
def model(tiny_model: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rows(model) -> tuple[list[list[int]], list[int]]:  # noqa: ANN001
    """64 prompts of 1..11 tokens (a few repeated, as a group's G rows are) and their seeds."""
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(48)
    ]
    prompts += prompts[:16]
    return prompts, list(range(500, 500 + ROWS))


def in_batches(model, prompts, seeds, size: int, decode: str, **kw):  # noqa: ANN001, ANN201
    out = []
    for i in range(0, len(prompts), size):
        out += sample(model, prompts[i : i + size], seeds[i : i + size], decode=decode, **kw)
    return out


def same_rows(a: list, b: list, tol: float = 1e-5) -> None:
    assert [r[0] for r in a] == [r[0] for r in b]
    assert [r[2] for r in a] == [r[2] for r in b]
    worst = max(
        max((abs(x - y) for x, y in zip(ra[1], rb[1], strict=True)), default=0.0)
        for ra, rb in zip(a, b, strict=True)
    )
    assert worst < tol, worst


@pytest.mark.slow  # 1 + 16 + 10 sample calls
def test_static_rows_do_not_depend_on_the_batch(model, rows) -> None:  # noqa: ANN001
    prompts, seeds = rows
    full = sample(model, prompts, seeds, max_new_tokens=6, decode="static", **OPTS)
    assert sum(len(r[0]) for r in full) > ROWS * 3  # most rows ran several steps
    # alone: every 4th row (12 prompts and 4 of the repeated ones), one sample call each
    same_rows(in_batches(model, prompts[::4], seeds[::4], 1, "static", max_new_tokens=6, **OPTS), full[::4])
    same_rows(in_batches(model, prompts, seeds, 7, "static", max_new_tokens=6, **OPTS), full)


def test_static_equals_dynamic_and_an_unpadded_forward(model, rows) -> None:  # noqa: ANN001
    prompts, seeds = rows
    kw = {"max_new_tokens": [3 + i % 9 for i in range(ROWS)], "temperature": 0.7, "top_k": 20, **OPTS}
    static = sample(model, prompts, seeds, decode="static", **kw)
    same_rows(static, sample(model, prompts, seeds, decode="dynamic", **kw))
    assert [len(r[0]) for r in static if r[2] == "length"] == [
        3 + i % 9 for i, r in enumerate(static) if r[2] == "length"
    ]
    for p, (toks, lps, _) in list(zip(prompts, static, strict=True))[
        :8
    ]:  # log_softmax(logits / 0.7) of one plain forward
        assert (torch.tensor(lps) - unpadded_logprobs(model, p, toks, 0.7)).abs().max() < 1e-5
        assert 1 not in toks  # the banned pad id is never drawn


def test_static_loop_reads_nothing_back_and_stops_once_done(model, rows, monkeypatch) -> None:  # noqa: ANN001
    """Inside the loop no Tensor method that waits for the device's values runs; with every id but
    two a stop id, every row ends within 3 steps, and the loop ends at the first check after."""
    prompts, seeds = rows
    calls: list[str] = []
    real_run = static_decode.run_steps
    ran: list[int] = []

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        originals = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "nonzero", "__bool__")}

        def spy(name: str):  # noqa: ANN202
            def call(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                calls.append(name)
                return originals[name](self, *a, **k)

            return call

        for n in originals:
            monkeypatch.setattr(torch.Tensor, n, spy(n))
        try:
            ran.append(real_run(*args, **kwargs))
        finally:
            for n, f in originals.items():
                monkeypatch.setattr(torch.Tensor, n, f)
        return ran[-1]

    monkeypatch.setattr(static_decode, "run_steps", counted)
    vocab = model.config.vocab_size
    out = sample(
        model,
        prompts,
        seeds,
        max_new_tokens=200,
        decode="static",
        check_every=4,
        stop_ids=set(range(2, vocab)),
        pad_id=1,
        banned_ids={1},
    )
    assert calls == []
    # a row goes on only on token 0 (1 is banned), p ~ 1/105 a step: every row stops within 3
    # steps; on a CPU the check at step 4 sees it at once (steps 1..4 ran)
    assert max(len(r[0]) for r in out) <= 3
    assert all(r[2] == "stop" for r in out)
    assert ran == [4], ran
