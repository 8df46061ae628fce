"""Forward passes that give the log-probs of response tokens: the same code for the behaviour
check in generate, the reference in score and the current policy in train.

Sequences are right-padded; the model's decoder runs once, and the LM head is applied only at
the positions that predict response tokens, in chunks (see core.logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf_batch.core.logprobs import chunked_logprobs

# Models whose logits are not plain `lm_head(hidden)`: for them the full forward is used.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids [B, L] and attention mask [B, L] (1 for real tokens)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L]
    attn = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, L]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    return ids.to(device), attn.to(device)


def response_mask(seq_lens: torch.Tensor, prompt_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: True at positions t whose next token (t + 1) is a response token."""
    pos = torch.arange(width, device=seq_lens.device)[None, :]  # [1, W]
    return (pos >= prompt_lens[:, None] - 1) & (pos < seq_lens[:, None] - 1)  # [B, W]


def response_logprobs(
    model: Any,
    seqs: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    temperature: float = 1.0,
    *,
    pad_id: int = 0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens of `seqs` (prompt + response token lists).

    Returns logp [B, T] float32, mask [B, T] bool (T = longest response; masks come from
    lengths, never from token values) and, if asked, per-token entropy [B, T].
    """
    device = next(model.parameters()).device
    ids, attn = pad_right(seqs, pad_id, device)  # [B, L]
    seq_lens = torch.as_tensor([len(s) for s in seqs], device=device)  # [B]
    p_lens = torch.as_tensor(list(prompt_lens), device=device)  # [B]
    if bool((p_lens < 1).any()):
        raise ValueError("every sequence needs at least one prompt token")
    sel = response_mask(seq_lens, p_lens, ids.shape[1] - 1)  # [B, L-1]
    targets = ids[:, 1:][sel]  # [N]
    if any(getattr(model.config, k, None) for k in _LOGIT_TRANSFORMS):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1][sel]  # [N, V]
        hidden, head = logits, (lambda x: x)
    else:
        out = model.get_decoder()(input_ids=ids, attention_mask=attn)
        hidden, head = out.last_hidden_state[:, :-1][sel], model.get_output_embeddings()  # [N, H]
    lp, ent = chunked_logprobs(hidden, head, targets, temperature, chunk_size, with_entropy)  # [N]
    r_lens = seq_lens - p_lens  # [B]
    width = int(r_lens.max()) if len(seqs) else 0
    mask = torch.arange(width, device=device)[None, :] < r_lens[:, None]  # [B, T]
    logp = lp.new_zeros(mask.shape).masked_scatter(mask, lp)  # [B, T]
    entropy = lp.new_zeros(mask.shape).masked_scatter(mask, ent) if ent is not None else None
    return logp, mask, entropy
