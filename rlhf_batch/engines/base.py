"""What generate needs from a generation engine, and the facts every engine shares: the token
ids a row stops on and the prompt lengths the model can take."""

from __future__ import annotations

from typing import Any, Protocol

from rlhf_batch.config import GenerateConfig
from rlhf_batch.data.prompts import Prompts
from rlhf_batch.errors import StageError


class Engine(Protocol):
    """What generate needs from a generation engine: per prompt (and seed), one sampled row
    (response_ids, behavior_logprobs, finish_reason 'stop' | 'length'), in input order, with
    behaviour log-probs defined as forward.py defines them; `bar` counts finished rows."""

    def sample(
        self, prompts: list[list[int]], seeds: list[int], bar: Any
    ) -> list[tuple[list[int], list[float], str]]: ...


def check_lengths(model: Any, prompts: Prompts, g: GenerateConfig) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(t) for t in prompts.tokens)
    if limit and longest + g.max_new_tokens > limit:
        raise StageError(
            f"{g.prompts}: longest prompt ({longest} tokens) + generate.max_new_tokens "
            f"({g.max_new_tokens}) exceeds the model's {limit} positions"
        )


def stop_ids(model: Any, tok: Any) -> set[int]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    extra = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    return ids | end_of_turn(tok)


def end_of_turn(tok: Any) -> set[int]:
    """The special token the chat template closes an assistant turn with (none without one)."""
    if not getattr(tok, "chat_template", None):
        return set()
    marker = "ZQXJ"
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    try:
        text = tok.apply_chat_template(turn, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render an assistant turn has no end token to add
        return set()
    if not isinstance(text, str) or marker not in text:
        return set()
    ids = tok(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
    return {ids[0]} if ids and ids[0] in special_ids(tok) else set()


def special_ids(tok: Any) -> set[int]:
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return set(tok.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
