"""The device side of score and train: LM-head passes sized by bytes off the CPU, the fused
attention kernels that return the log-sum-exp (chosen per device; the CUDA ones checked for
shapes on the meta device, their math by the CPU kernel that shares the wrapper), and the
train forward whose indices come from the host (the same numbers as the boolean-mask path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_batch.core.logprobs import pass_rows
from rlhf_batch.models import attention
from rlhf_batch.models.forward import default_chunk_size, padded_logprobs, response_positions
from rlhf_batch.models.load import load_model


def test_passes_off_the_cpu_are_sized_by_a_byte_budget() -> None:
    # DEVICE_PASS_BYTES = 256 MiB = 268435456 bytes of float32 logits: 268435456 / (4 x 151936)
    # = 441.7 -> 441 rows; / (4 x 32000) = 2097.2 -> 2097; the CPU keeps 16-row passes
    assert (pass_rows(151936, "cuda"), pass_rows(32000, "cuda")) == (441, 2097)
    assert (pass_rows(151936), pass_rows(151936, "cpu")) == (16, 16)
    # a device chunk is one pass, within [256, 65536]: the demo's 105 tokens -> 65536
    assert default_chunk_size(151936, True, "cuda") == 441 and default_chunk_size(105, True, "cuda") == 65536
    assert default_chunk_size(151936, True, "cpu") == 512  # unchanged
    assert default_chunk_size(32000, False, "cuda") == 65  # a non-linear head: as on a CPU


def _meta(
    b: int, h: int, kv: int, q: int, length: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    m = "meta"
    return (
        torch.empty(b, h, q, d, device=m, dtype=dtype),
        torch.empty(b, kv, length, d, device=m, dtype=dtype),
        torch.empty(b, kv, length, d, device=m, dtype=dtype),
    )


def test_the_attention_kernel_is_chosen_by_device_dtype_and_head_size() -> None:
    cpu = torch.zeros(1, 2, 3, 8)
    assert attention.lse_kernel(cpu, cpu, True) == "cpu_flash"  # any dtype, as before
    q, k, _ = _meta(2, 4, 2, 5, 5, 64, torch.bfloat16)
    assert attention.lse_kernel(q, k, True, capability=9) == "flash"
    assert attention.lse_kernel(q, k, True, capability=7) == "efficient"  # flash needs sm80+
    q32, k32, _ = _meta(2, 4, 2, 5, 5, 64, torch.float32)
    assert attention.lse_kernel(q32, k32, False, capability=9) == "efficient"  # flash: 16-bit only
    q12, k12, _ = _meta(2, 4, 2, 5, 5, 12, torch.bfloat16)
    assert attention.lse_kernel(q12, k12, False, capability=9) == "matmul"  # head dim not a multiple of 8
    q192, k192, _ = _meta(1, 2, 2, 5, 5, 192, torch.float32)
    assert attention.lse_kernel(q192, k192, False, capability=9) == "matmul"  # efficient: <= 128
    qs, ks, _ = _meta(1, 2, 2, 3, 7, 64, torch.bfloat16)
    assert attention.lse_kernel(qs, ks, True, capability=9) == "matmul"  # causal, q != L
    assert attention.lse_kernel(qs, ks, False, capability=9) == "flash"  # non-causal: any L


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_the_cuda_kernels_return_the_shapes_attend_with_lse_promises(kernel: str) -> None:
    # on the meta device (shapes only): grouped keys (4 query heads, 2 key heads) are repeated,
    # the efficient kernel's log-sum-exp, padded to 32 queries, is cut to the 5 queries
    q, k, v = _meta(2, 4, 2, 5, 9, 64, torch.bfloat16)
    out, lse = attention.fused_attention_lse(kernel, q, k, v, False, 0.125)
    assert out.shape == (2, 4, 5, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_attend_with_lse_fused_refuses_where_no_kernel_applies() -> None:
    q, k, v = _meta(1, 2, 2, 5, 5, 12, torch.bfloat16)
    with pytest.raises(ValueError, match="no fused attention kernel"):
        attention.attend_with_lse(q, k, v, True, 1.0, fused=True)
    out, lse = attention.attend_with_lse(q, k, v, True, 1.0)  # default: the matmul route
    assert out.shape == (1, 2, 5, 12) and lse.shape == (1, 2, 5)


def test_response_positions_by_hand() -> None:
    # rows: 5 tokens (prompt 2) and 3 tokens (prompt 1): L = 5, T = max(3, 2) = 3.
    # row 0 predicts its response tokens from positions 1, 2, 3 -> flat 1, 2, 3; row 1 from
    # positions 0, 1 -> flat 5 + 0, 5 + 1 = 5, 6. Places: row 0 -> 0, 1, 2; row 1 -> 3, 4.
    select, place, mask = response_positions(np.array([5, 3]), np.array([2, 1]))
    assert select.tolist() == [1, 2, 3, 5, 6] and place.tolist() == [0, 1, 2, 3, 4]
    assert mask.tolist() == [[True, True, True], [True, True, False]]


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    return load_model(str(tiny_model), "policy", dtype="float32")


def _rows(vocab: int) -> tuple[list[list[int]], list[int]]:
    g = np.random.default_rng(5)
    seqs = [g.integers(1, vocab, n).tolist() for n in (9, 4, 12, 6)]
    return seqs, [3, 1, 5, 6]  # the last row has no response token


def _boolean_mask_path(model, seqs, p_lens, with_entropy: bool):  # type: ignore[no-untyped-def]
    """The forward as it was written before: positions picked by a boolean mask, log-probs put
    back by masked_scatter (the device reads the mask's count back to the host)."""
    from rlhf_batch.core.logprobs import chunked_logprobs
    from rlhf_batch.models.forward import output_head, pad_right

    ids, _ = pad_right(seqs, 0, "cpu")
    seq_lens, p = torch.tensor([len(s) for s in seqs]), torch.tensor(p_lens)
    pos = torch.arange(ids.shape[1] - 1)[None, :]
    sel = (pos >= p[:, None] - 1) & (pos < seq_lens[:, None] - 1)
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1][sel]
    lp, ent = chunked_logprobs(hidden, output_head(model), ids[:, 1:][sel], 0.7, 512, with_entropy)
    mask = torch.arange(int((seq_lens - p).max()))[None, :] < (seq_lens - p)[:, None]
    logp = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
    return logp, (lp.new_zeros(mask.shape).masked_scatter(mask, ent) if with_entropy else None)


def test_host_indexed_forward_equals_the_boolean_mask_path_bit_for_bit(model) -> None:  # type: ignore[no-untyped-def]
    # float32 on the CPU, log-probs, entropies and every parameter's gradient: the same
    # gathers and the same LM head, so the same bits
    seqs, p_lens = _rows(model.config.vocab_size)
    select, place, mask = response_positions(np.array([len(s) for s in seqs]), np.array(p_lens))
    from rlhf_batch.models.forward import pad_right

    ids, _ = pad_right(seqs, 0, "cpu")
    results = []
    for run in ("host", "mask"):
        model.zero_grad(set_to_none=True)
        if run == "host":
            logp, ent = padded_logprobs(
                model, ids, torch.from_numpy(select), torch.from_numpy(place), mask.shape[1], 0.7, chunk_size=512, with_entropy=True
            )  # fmt: skip
        else:
            logp, ent = _boolean_mask_path(model, seqs, p_lens, True)
        assert ent is not None
        (logp.sum() + 0.3 * ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b, strict=True))
    assert (lp_a[3] == 0).all() and (lp_a[1, 3:] == 0).all()  # no response / past it: 0


def test_bf16_autocast_forward_is_within_its_tolerance_of_float32_full_logits(model) -> None:  # type: ignore[no-untyped-def]
    # bf16 even where dtype auto picks float32 (a CPU without bf16 units): the decoder and the
    # head in bf16 under autocast, log-softmax in float32. Oracle: the model's own full logits in
    # float32, log_softmax(logits / T) at each response token. bf16 keeps 8 bits of mantissa
    # (relative error 2^-8 = 0.004 per rounding): over two layers and the head the log-probs
    # (magnitude ~ln 105 = 4.7) stay within 0.05, as tests/models/test_bf16_path.py allows.
    seqs, p_lens = _rows(model.config.vocab_size)
    select, place, mask = response_positions(np.array([len(s) for s in seqs]), np.array(p_lens))
    from rlhf_batch.models.forward import pad_right

    ids, _ = pad_right(seqs, 0, "cpu")
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, _ = padded_logprobs(
                model, ids, torch.from_numpy(select), torch.from_numpy(place), mask.shape[1], 0.7
            )
        logits = model(input_ids=ids).logits.float() / 0.7  # [B, L, V]
    want = torch.zeros_like(got)
    for k, (s, p) in enumerate(zip(seqs, p_lens, strict=True)):
        lsm = torch.log_softmax(logits[k, p - 1 : len(s) - 1], -1)  # [r, V]
        want[k, : len(s) - p] = lsm.gather(-1, torch.tensor(s[p:])[:, None]).squeeze(-1)
    m = torch.from_numpy(mask)
    assert got.dtype == torch.float32 and float((got - want)[m].abs().max()) < 0.05
    assert (got[~m] == 0).all()
