"""The tokens an environment's message adds to a trajectory: the policy's chat template renders
the message (role "tool" or "user") after an assistant turn and opens the next assistant turn,
and the text between the assistant's content and that next turn is tokenised (special tokens
recognised). When the assistant turn ended on its stop token (e.g. `<|im_end|>`, already in the
response), the rendering's copy of it is left out. A tokenizer without a chat template gets
"\\n" + observation + "\\n"."""

from __future__ import annotations

from typing import Any

MARK = "ZQXJ\u2063"  # an assistant content no template rewrites


def glue_text(tok: Any, role: str, observation: str) -> str:
    """The text from the end of an assistant turn's content to the start of the next one's."""
    if not getattr(tok, "chat_template", None):
        return "\n" + observation + "\n"
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
    full = tok.apply_chat_template(
        [*turns, {"role": role, "content": observation}], tokenize=False, add_generation_prompt=True
    )
    return full.split(MARK, 1)[1]


def observation_ids(tok: Any, role: str, observation: str, last_id: int | None, stopped: bool) -> list[int]:
    """The tokens that follow an assistant turn whose last token is `last_id` (`stopped`: it is
    its stop token, which the glue then does not repeat)."""
    text = glue_text(tok, role, observation)
    if stopped and last_id is not None:
        end = tok.decode([last_id], skip_special_tokens=False)
        if end and text.startswith(end):
            text = text[len(end) :]
    return list(tok(text, add_special_tokens=False)["input_ids"])
