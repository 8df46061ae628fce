"""Forward passes that give the log-probs of response tokens: the same code for the behaviour
check in generate, the reference in score and the current policy in train.

Sequences are right-padded; the model's decoder runs once, and the LM head is applied only at
the positions that predict response tokens, in chunks (see core.logprobs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlhf_batch.core.batching import token_budget_batches
from rlhf_batch.core.logprobs import chunked_logprobs, pass_rows, plain_linear
from rlhf_batch.models.attention import PromptPrefix, prefix_attention_for

# Config keys of models whose logits are not plain `lm_head(hidden)` (Gemma 2/3, Cohere, Granite).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_head(model: Any) -> Any:
    """hidden [N, H] -> logits [N, V] as the model's own forward computes them: the LM head, then
    the family's logit transform (tanh soft-capping, a scale or a divisor), so that the head can
    be applied in chunks."""
    head, c = model.get_output_embeddings(), model.config
    cap = getattr(c, "final_logit_softcapping", None)
    scale = getattr(c, "logit_scale", None)
    divisor = getattr(c, "logits_scaling", None)
    if not (cap or scale or divisor):
        return head

    def transformed(h: torch.Tensor) -> torch.Tensor:
        logits = head(h)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if scale:
            logits = logits * scale
        if divisor:
            logits = logits / divisor
        return logits

    return transformed


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids [B, L] and attention mask [B, L] (1 for real tokens)."""
    lens = np.fromiter(map(len, seqs), np.int64, len(seqs))  # [B]
    real = np.arange(int(lens.max()))[None, :] < lens[:, None]  # [B, L]
    ids = np.full(real.shape, pad_id, np.int64)  # [B, L]
    ids[real] = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, int(lens.sum()))  # row by row
    return torch.from_numpy(ids).to(device), torch.from_numpy(real.astype(np.int64)).to(device)


def response_positions(
    seq_lens: np.ndarray, prompt_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host-side indices of right-padded rows (seq_lens [B], prompt_lens [B] >= 1) -> (select
    [N]: flat positions into [B, L] (L = longest row) of the hidden states that predict response
    tokens, row k's j-th at k L + prompt_k - 1 + j; place [N]: their flat positions into [B, T]
    (T = longest response), k T + j; mask [B, T] bool), N = the response tokens, row by row."""
    seq, plen = np.asarray(seq_lens, np.int64), np.asarray(prompt_lens, np.int64)  # [B]
    resp = seq - plen  # [B]
    width, length = int(resp.max(initial=0)), int(seq.max(initial=0))
    rows = np.repeat(np.arange(len(seq)), resp)  # [N]
    j = np.arange(len(rows)) - np.repeat(np.cumsum(resp) - resp, resp)  # [N] position in its response
    mask = np.arange(width)[None, :] < resp[:, None]  # [B, T]
    return rows * length + plen[rows] - 1 + j, rows * width + j, mask


def padded_logprobs(
    model: Any,
    ids: torch.Tensor,
    select: torch.Tensor,
    place: torch.Tensor,
    width: int,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` on the device side: right-padded ids [B, L] and `select`, `place` [N]
    (`response_positions`, on the model's device) -> logp [B, width] float32 (0 past each row's
    response) and, if asked, entropy [B, width]. No host sync: every shape is known already."""
    # No attention mask: rows are right-padded, so under causal attention no real position sees a
    # pad (pads come after it), and the attention kernel runs its causal form, skipping the
    # blocks above the diagonal, instead of reading a [B, 1, L, L] mask. Pad positions' outputs
    # are never used.
    b = ids.shape[0]
    out = model.get_decoder()(input_ids=ids)
    hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]).index_select(
        0, select
    )  # [N, H]
    targets = ids.reshape(-1).index_select(0, select + 1)  # [N]: the token after each position
    head = output_head(model)
    vocab = int(model.config.get_text_config().vocab_size)
    chunk = chunk_size or default_chunk_size(vocab, plain_linear(head), ids.device.type)
    lp, ent = chunked_logprobs(hidden, head, targets, temperature, chunk, with_entropy)  # [N]
    logp = lp.new_zeros(b * width).index_copy(0, place, lp).view(b, width)  # [B, T]
    entropy = lp.new_zeros(b * width).index_copy(0, place, ent).view(b, width) if ent is not None else None
    return logp, entropy


def response_logprobs(
    model: Any,
    seqs: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    temperature: float = 1.0,
    *,
    pad_id: int = 0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens of `seqs` (prompt + response token lists).

    Returns logp [B, T] float32, mask [B, T] bool (T = longest response; masks come from
    lengths, never from token values) and, if asked, per-token entropy [B, T]. `chunk_size`
    (LM-head rows at a time) defaults to `default_chunk_size(vocab)`.
    """
    device = next(model.parameters()).device
    p_lens = np.asarray(list(prompt_lens), np.int64)  # [B]
    if (p_lens < 1).any():
        raise ValueError("every sequence needs at least one prompt token")
    ids, _ = pad_right(seqs, pad_id, device)  # [B, L]
    select, place, mask = response_positions(np.fromiter(map(len, seqs), np.int64, len(seqs)), p_lens)
    sel, put = (torch.from_numpy(x).to(device) for x in (select, place))  # [N] each
    logp, entropy = padded_logprobs(
        model, ids, sel, put, mask.shape[1], temperature, chunk_size=chunk_size, with_entropy=with_entropy
    )
    return logp, torch.from_numpy(mask).to(device), entropy


# ---------------------------------------------------------------- shared prompts

_SHARED_PREFIX_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
)  # plain causal attention, DynamicCache, RoPE from position_ids


def can_share_prefix(model: Any) -> bool:
    """Whether `shared_prefix_logprobs` applies: a plain-attention decoder of a known family."""
    c = model.config
    return (
        c.model_type in _SHARED_PREFIX_TYPES
        and not getattr(c, "use_sliding_window", False)
        and not any(getattr(c, k, None) for k in _LOGIT_TRANSFORMS)
    )


def default_chunk_size(vocab_size: int, linear: bool = True, device_type: str = "cpu") -> int:
    """LM-head rows per chunk. A plain linear head (`linear`, `core.logprobs.linear_logprobs`):
    512, enough for its matmul to run near the peak (its float32 passes run over a few rows at a
    time whatever the chunk: core.logprobs.pass_rows), or up to 4096 where 2^21 logits hold more
    rows (a small vocabulary). Bf16 on a CPU with AMX, log-probs of 8192 rows (forward) / 2048
    rows (forward + backward): vocab 32000 x 512, 39.7 against 41.5 us a row at 262 rows / 140
    against 225 at 65; vocab 151936 x 896, 266 against 504 at 55 rows / 1332 against 2963 at 32.
    Its logits take [512, V] in the head's dtype (33 MB at vocab 32000 in bf16, 156 MB at 151936).
    Any other head (a logit transform, LoRA, a quantized layer) runs its float32 passes over the
    whole chunk: 2^21 logits (8 MB in float32), at least 32 rows and at most 4096.

    On an accelerator (`device_type` not "cpu") a plain linear head's chunk is one float32 pass
    (`pass_rows`, sized by a byte budget: 441 rows at vocab 151,936), between 256 and 65536 rows:
    each op of a pass is one kernel launch over all its rows."""
    if linear and device_type != "cpu":
        return max(256, min(65536, pass_rows(vocab_size, device_type)))
    if linear:
        return min(4096, max(512, (1 << 21) // max(1, vocab_size)))
    return max(32, min(4096, (1 << 21) // max(1, vocab_size)))


def shared_prefix_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    prompt_of: Sequence[int],
    temperature: float = 1.0,
    *,
    pad_id: int = 0,
    max_tokens: int = 16384,
) -> list[torch.Tensor]:
    """Log-probs [len(response)] float32 of `responses[i]` after `prompts[prompt_of[i]]`, each
    prompt run through the decoder once (the G samples of a GRPO group share it).

    The prompts' keys and values are kept, once per prompt; responses are run in batches of
    similar length (<= `max_tokens` response tokens, <= 4 x `max_tokens` with their prompts'
    positions) with position ids continuing each row's prompt, and attend to their prompt's keys
    through `attention.prefix_attention` (no per-row copy of the prompt, no padding to the
    batch's longest prompt). Same numbers as `response_logprobs` on the full sequences up to
    float rounding; only for `can_share_prefix` models.
    """
    device = next(model.parameters()).device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    chunk = default_chunk_size(head.weight.shape[0], plain_linear(head), device.type)
    keys, values, last = _prefill(
        decoder, prompts, pad_id, max_tokens, device
    )  # [layers][n][kvh, P, d], [n, H]
    out: list[torch.Tensor] = [torch.zeros(0)] * len(responses)
    for rows in _response_batches(
        [len(r) for r in responses], [len(prompts[j]) for j in prompt_of], max_tokens
    ):
        rows = sorted(rows, key=lambda i: prompt_of[i])  # the rows of one prompt adjacent
        p_lens = [len(prompts[prompt_of[i]]) for i in rows]
        r_lens = [len(responses[i]) for i in rows]
        ids, r_attn = pad_right([responses[i] for i in rows], pad_id, device)  # [b, R]
        pos = torch.tensor(p_lens, device=device)[:, None] + torch.arange(
            ids.shape[1], device=device
        )  # [b, R]
        starts = [k for k in range(len(rows)) if k == 0 or prompt_of[rows[k]] != prompt_of[rows[k - 1]]]
        spans = [(prompt_of[rows[s]], s, e) for s, e in zip(starts, [*starts[1:], len(rows)], strict=True)]
        prefix = PromptPrefix(keys, values, spans)
        with prefix_attention_for(decoder):  # right-padded, causal: no mask (as in response_logprobs)
            hid = decoder(
                input_ids=ids, position_ids=pos, use_cache=False, prompt_prefix=prefix
            ).last_hidden_state  # [b, R, H]
        h = torch.cat(
            [
                torch.cat([last[prompt_of[i]][None], hid[k, : r - 1]])
                for k, (i, r) in enumerate(zip(rows, r_lens, strict=True))
            ]
        )  # [N, H]
        targets = ids[r_attn.bool()]  # [N]
        lp, _ = chunked_logprobs(h, head, targets, temperature, chunk)  # [N]
        for i, piece in zip(rows, lp.split(r_lens), strict=True):
            out[i] = piece
    return out


def _prefill(
    decoder: Any, prompts: Sequence[Sequence[int]], pad_id: int, max_tokens: int, device: Any
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], torch.Tensor]:
    """Each prompt once through the decoder: per layer each prompt's keys and values [kvh, P, d]
    and the last prompt position's hidden state [n, H]."""
    from transformers import DynamicCache

    n_layers = decoder.config.num_hidden_layers
    keys: list[list[Any]] = [[None] * len(prompts) for _ in range(n_layers)]
    values: list[list[Any]] = [[None] * len(prompts) for _ in range(n_layers)]
    last: list[Any] = [None] * len(prompts)
    for batch in token_budget_batches([len(p) for p in prompts], max_tokens):
        ids, _ = pad_right([prompts[j] for j in batch], pad_id, device)  # [b, P] right-padded
        cache: Any = DynamicCache()
        # causal, no mask: right-padded, no real position sees a pad (as in response_logprobs)
        hid = decoder(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
        for k, j in enumerate(batch):
            p = len(prompts[j])
            last[j] = hid[k, p - 1]  # [H]
            for layer in range(n_layers):
                keys[layer][j] = cache.layers[layer].keys[k, :, :p]  # [kvh, p, d]
                values[layer][j] = cache.layers[layer].values[k, :, :p]
    return keys, values, torch.stack(last)


def _response_batches(
    r_lens: Sequence[int], p_lens: Sequence[int], max_tokens: int, max_padding: float = 0.1
) -> list[list[int]]:
    """Rows with a response, longest response first, cut so that rows x longest response <=
    max_tokens, rows x (longest prompt + longest response) <= 4 x max_tokens, and padding stays
    within `max_padding` of the batch's response positions (rows x longest response): a batch
    that mixed the long tail with short responses would run the decoder mostly on padding."""
    order = sorted((i for i in range(len(r_lens)) if r_lens[i] > 0), key=lambda i: (-r_lens[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    r_max = p_max = real = 0
    for i in order:
        r2, p2, n = max(r_max, r_lens[i]), max(p_max, p_lens[i]), len(cur) + 1
        too_big = n * r2 > max_tokens or n * (r2 + p2) > 4 * max_tokens
        if cur and (too_big or real + r_lens[i] < (1.0 - max_padding) * n * r2):
            batches.append(cur)
            cur, r2, p2, real = [], r_lens[i], p_lens[i], 0
        cur.append(i)
        r_max, p_max = r2, p2
        real += r_lens[i]
    if cur:
        batches.append(cur)
    return batches


def batched_logprobs(
    model: Any,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    *,
    pad_id: int,
    max_tokens: int,
    progress: Any = None,
) -> list[np.ndarray]:
    """Log-probs [len(response)] float32 of every row's response tokens, in input order.

    Rows that share their prompt (the G samples of a group) run it through the model once
    (shared_prefix_logprobs, for the model families it supports); otherwise token-budget
    batches over length-sorted rows (response_logprobs)."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(lengths)
    uniq: dict[tuple[int, ...], int] = {}
    prompt_of = [uniq.setdefault(tuple(p), len(uniq)) for p in prompt_ids]
    with torch.inference_mode():
        if len(uniq) < len(prompt_ids) and can_share_prefix(model):
            for rows in _prompt_chunks(prompt_of, [len(p) for p in uniq], 8 * max_tokens):
                local: dict[int, int] = {}  # prompt index -> its index among this chunk's prompts
                for r in rows:
                    local.setdefault(prompt_of[r], len(local))
                first = {j: r for r in reversed(rows) for j in [prompt_of[r]]}  # a row of each prompt
                lps = shared_prefix_logprobs(
                    model,
                    [prompt_ids[first[j]] for j in local],
                    [response_ids[i] for i in rows],
                    [local[prompt_of[i]] for i in rows],
                    temperature,
                    pad_id=pad_id,
                    max_tokens=max_tokens,
                )
                kept = [k for k, i in enumerate(rows) if len(response_ids[i])]
                if kept:  # one copy to the host for the chunk (a device waits once, not per row)
                    flat = torch.cat([lps[k] for k in kept]).cpu().numpy()
                    for k, piece in zip(
                        kept, np.split(flat, np.cumsum([len(lps[k]) for k in kept])[:-1]), strict=True
                    ):
                        out[rows[k]] = piece
                if progress is not None:
                    progress(sum(lengths[i] for i in rows))
            return out
        for batch in token_budget_batches(lengths, max_tokens):
            seqs = [prompt_ids[i] + response_ids[i] for i in batch]
            logp, _, _ = response_logprobs(
                model, seqs, [len(prompt_ids[i]) for i in batch], temperature, pad_id=pad_id
            )  # [b, T]
            logp_np = logp.cpu().numpy()  # [b, T]
            for j, i in enumerate(batch):
                out[i] = logp_np[j, : len(response_ids[i])].copy()  # [T_i]
            if progress is not None:
                progress(sum(lengths[i] for i in batch))
    return out


def _prompt_chunks(prompt_of: list[int], p_lens: list[int], max_prompt_tokens: int) -> list[list[int]]:
    """Rows cut into chunks of whole groups whose distinct prompts hold <= max_prompt_tokens
    tokens (one group at least): the prompts' keys and values of a chunk are kept in memory."""
    groups: dict[int, list[int]] = {}
    for i, j in enumerate(prompt_of):
        groups.setdefault(j, []).append(i)
    chunks: list[list[int]] = []
    held = max_prompt_tokens
    for j, rows in groups.items():
        if held + p_lens[j] > max_prompt_tokens:
            chunks.append([])
            held = 0
        chunks[-1].extend(rows)
        held += p_lens[j]
    return chunks
