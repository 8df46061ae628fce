"""The tokens an environment's messages add to a trajectory: the policy's chat template renders
the messages (role "tool" or "user") after an assistant turn and opens the next assistant turn,
and the text between the assistant's content and that next turn is tokenised (special tokens
recognised), one segment per message: a message's segment runs from the end of the one before
(the assistant's content for the first) to the end of its own content, the last one's on to
the next assistant turn, as `import` splits a conversation (data/chat_turns.py), so several
tool results of one turn give the tokens `import` gives their messages. When the assistant
turn ended on its stop token (e.g. `<|im_end|>`, already in the response), the rendering's copy
of it is left out. A tokenizer without a chat template gets "\\n" + observation + "\\n"."""

from __future__ import annotations

from typing import Any

MARK = "ZQXJ\u2063"  # an assistant content no template rewrites
PLACEHOLDER = "@@rlhf-batch-observation-{}@@"


def glue_texts(tok: Any, role: str, observations: list[str]) -> list[str]:
    """The text from the end of an assistant turn's content to the start of the next one's,
    cut after each message's content (one piece per message)."""
    if not getattr(tok, "chat_template", None):
        return ["\n" + "\n".join(observations) + "\n"]
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
    msgs = [{"role": role, "content": PLACEHOLDER.format(i)} for i in range(len(observations))]
    full = tok.apply_chat_template([*turns, *msgs], tokenize=False, add_generation_prompt=True)
    rest, out = full.split(MARK, 1)[1], []
    for i, obs in enumerate(observations):
        before, rest = rest.split(PLACEHOLDER.format(i), 1)
        out.append(before + obs)
    out[-1] += rest
    return out


def glue_text(tok: Any, role: str, observation: str) -> str:
    """The text from the end of an assistant turn's content to the start of the next one's."""
    return "".join(glue_texts(tok, role, [observation]))


def observation_ids(
    tok: Any, role: str, observation: str | list[str], last_id: int | None, stopped: bool
) -> list[list[int]]:
    """The tokens of each message that follows an assistant turn whose last token is `last_id`
    (`stopped`: it is its stop token, which the glue then does not repeat)."""
    texts = glue_texts(tok, role, [observation] if isinstance(observation, str) else observation)
    if stopped and last_id is not None:
        end = tok.decode([last_id], skip_special_tokens=False)
        if end and texts[0].startswith(end):
            texts[0] = texts[0][len(end) :]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
