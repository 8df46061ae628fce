"""Reward-model scorer: a local 1-label ``AutoModelForSequenceClassification`` scoring prompt +
response token ids, read at the last real token of each sequence (its end score).

The Hugging Face head pools at "the last token that is not the pad id", which is wrong when the
pad id is the EOS id and the response ends with EOS. Here the position comes from the lengths
instead: sequences are right-padded and the head is applied to the hidden state at index
``len - 1`` of each row, so padding never changes a row's score.

A reward model whose tokenizer has the policy's vocabulary reads the rollouts' token ids as
they are. One with another tokenizer reads the decoded text re-tokenised with its own
tokenizer, as TRL's ``reward_processing_classes`` do: for chat prompts (`prompt_messages`) and a
tokenizer with a chat template, the template applied to the prompt's messages plus the
response as the assistant turn; otherwise the prompt text followed by the response text (no
special tokens added in either case).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rlhf_batch.core.batching import token_budget_batches
from rlhf_batch.errors import ModelError
from rlhf_batch.models.forward import pad_right
from rlhf_batch.models.load import load_model, load_tokenizer, vocab_signature
from rlhf_batch.store.modeldir import check_model_dir


class RewardModel:
    """End scores of token sequences from a local reward model (float32, one per sequence)."""

    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        policy_tokenizer: Any = None,
    ):
        self.path = path
        archs = json.loads((check_model_dir(path, "reward_model") / "config.json").read_text()).get(
            "architectures"
        )
        if not archs or not all(a.endswith("ForSequenceClassification") for a in archs):
            raise ModelError(  # loading it anyway would give a randomly initialised score head
                f"reward_model: {path} is not a sequence-classification model (architectures: {archs})"
            )
        self.model = load_model(
            path,
            "reward_model",
            kind="reward",
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
        )
        self.tokenizer = load_tokenizer(path, trust_remote_code)
        base = getattr(self.model, self.model.base_model_prefix, None)
        head = getattr(self.model, "score", None)
        if not isinstance(base, torch.nn.Module) or not isinstance(head, torch.nn.Module):
            raise ModelError(
                f"reward_model: {path} ({type(self.model).__name__}) has no decoder + 'score' head; "
                "only decoder-only sequence-classification models are supported"
            )
        self.base: torch.nn.Module = base
        self.head: torch.nn.Module = head
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.same_vocab = policy_tokenizer is None or vocab_signature(policy_tokenizer) == vocab_signature(
            self.tokenizer
        )

    def sequences(
        self, t: Any, prompt_ids: list[list[int]], response_ids: list[list[int]]
    ) -> list[list[int]]:
        """The token ids this model reads for each rollout of table `t` (see the module docstring)."""
        if self.same_vocab:
            return [p + r for p, r in zip(prompt_ids, response_ids, strict=True)]
        from rlhf_batch.data.prompts import MESSAGES

        prompts, responses = t["prompt"].to_pylist(), t["response"].to_pylist()
        if MESSAGES in t.column_names and getattr(self.tokenizer, "chat_template", None):
            texts = [
                self.tokenizer.apply_chat_template([*m, {"role": "assistant", "content": r}], tokenize=False)
                for m, r in zip(t[MESSAGES].to_pylist(), responses, strict=True)
            ]
        else:
            texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        ids: list[list[int]] = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        empty = [i for i, x in enumerate(ids) if not x]
        if empty:
            raise ModelError(
                f"reward_model: {self.path}: rollout row {empty[0]} has no tokens with its tokenizer"
            )
        return ids

    @torch.inference_mode()
    def end_scores(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B] float32 scores of one batch of token lists (each at least one token)."""
        device = next(self.model.parameters()).device
        ids, attn = pad_right(seqs, self.pad_id, device)  # [B, L]
        hidden = self.base(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, L, H]
        last = attn.sum(dim=1) - 1  # [B] index of the last real token
        h_end = hidden[torch.arange(len(seqs), device=device), last]  # [B, H]
        scores: torch.Tensor = self.head(h_end).float().squeeze(-1)  # [B]
        return scores

    def scores(
        self, seqs: Sequence[Sequence[int]], max_tokens: int, progress: Callable[[int], Any] | None = None
    ) -> np.ndarray:
        """[B] float64 end scores in input order, batched by token budget over length-sorted rows."""
        out = np.zeros(len(seqs), dtype=np.float64)  # [B]
        for batch in token_budget_batches([len(s) for s in seqs], max_tokens):
            out[batch] = self.end_scores([seqs[i] for i in batch]).cpu().numpy()  # [b]
            if progress is not None:
                progress(sum(len(seqs[i]) for i in batch))
        return out
