"""Tiny local models for tests, demos and benchmarks: no download, `save_pretrained` format.

The tokenizer is character-level over printable ASCII plus newline and tab (a byte-level BPE
vocabulary with no merges, so every Hugging Face loader reads it the same way); any other
character maps to <|unk|>. It has a ChatML chat template.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    pass

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
# ChatML; with tools, tool calls and tool results rendered as Qwen2.5's template renders them
# (a `# Tools` system block, `<tool_call>` JSON, results of role "tool" as `<tool_response>`
# blocks of a user turn). Without them it renders what the plain ChatML template rendered.
TOOLS_BLOCK = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
)
TOOL_MESSAGE = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
)
TOOL_CALLS = (
    "<|im_start|>assistant{% if m['content'] %}\n{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] %}{% if c['function'] is defined %}{% set c = c['function'] %}{% endif %}"
    '\n<tool_call>\n{"name": "{{ c[\'name\'] }}", "arguments": {{ c[\'arguments\'] | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
)
CHAT_TEMPLATE = (
    TOOLS_BLOCK + "{% for m in messages %}"
    "{% if m['role'] == 'system' and tools and loop.first %}"
    "{% elif m['role'] == 'tool' %}"
    + TOOL_MESSAGE
    + "{% elif m['role'] == 'assistant' and m['tool_calls'] %}"
    + TOOL_CALLS
    + "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
).replace("%}\n", "%}{{ '\\n' }}")  # transformers renders with trim_blocks: a newline after a tag is dropped
# The calculator task's vocabulary (init_model(extra_tokens=CALCULATOR_TOKENS)): a calculator call
# in the hermes format the template renders, and the tool result's markup, each a single token
# (added tokens, matched in the text before the character-level split), so that a call of
# "37*58" is 7 tokens, not 81: the opening up to the expression, its characters, the closing.
CALL_OPEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}\n</tool_call>'
CALCULATOR_TOKENS = (CALL_OPEN, CALL_CLOSE, "<tool_response>\n", "\n</tool_response>")
PadMode = Literal["separate", "eos", "none"]
DTYPES = ("float32", "bfloat16", "float16")  # init-model --dtype
# Named shapes for init-model --shape: the size options of init_model. qwen2.5-0.5b is the
# architecture of Qwen/Qwen2.5-0.5B(-Instruct) (494M parameters, tied embeddings), random weights
# and the char-level tokenizer padded to its vocabulary.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab_size": 0},
    "qwen2.5-0.5b": {
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "vocab_size": 151936,
    },
}


def build_tokenizer(  # noqa: ANN201
    pad: PadMode = "separate", vocab_size: int = 0, extra_tokens: tuple[str, ...] = ()
):
    """A char-level fast tokenizer; `vocab_size` > base pads the vocabulary with unused tokens;
    `extra_tokens`: strings that become one token each (added after the padding, not special:
    matched in any text, kept when decoding with skip_special_tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = {ord(c): c for c in pre_tokenizers.ByteLevel.alphabet()}
    chars = sorted(byte_char.get(b) or _byte_level(b) for b in (string.printable.encode()))
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    for i in range(len(vocab), vocab_size):
        vocab[f"<|unused_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra_tokens])
    kw = {"eos_token": "<|endoftext|>", "unk_token": "<|unk|>"}
    if pad != "none":
        kw["pad_token"] = "<|pad|>" if pad == "separate" else "<|endoftext|>"
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    out.chat_template = CHAT_TEMPLATE
    return out


def _byte_level(b: int) -> str:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(chr(b))[0][0]


def init_model(
    out_dir: str | Path,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 0,
    reward: bool = False,
    pad: PadMode = "separate",
    seed: int = 0,
    max_positions: int = 2048,
    dtype: str = "float32",
    extra_tokens: tuple[str, ...] = (),
) -> Path:
    """Build a random-initialised causal LM (or a 1-label reward model) and its tokenizer. The
    weights are drawn in float32 and saved in `dtype` (float32, bfloat16 or float16: rounded
    from the float32 draw), which config.json records; train saves its policies in it.
    `extra_tokens`: build_tokenizer's (e.g. CALCULATOR_TOKENS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a one-file model
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    tok = build_tokenizer(pad, vocab_size, extra_tokens)
    cfg = model_config(tok, arch, hidden, layers, heads, kv_heads, intermediate, reward, max_positions)
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    model = cls.from_config(cfg, dtype=torch.float32)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    from rlhf_batch.store.atomic import write_dir_atomic
    from rlhf_batch.store.fs import put_dir, run_path, store_of

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    out = run_path(out_dir, "init-model")
    if not out.exists():  # a new directory appears whole or not at all (on a store: file by file)
        write_dir_atomic(out, write)
    elif store_of(out).local:  # the user's own directory: write into it
        write(out)
    else:  # a prefix with objects already: the model's files are uploaded over theirs, others kept
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlhf-batch-") as d:
            write(Path(d))
            put_dir(Path(d), out)
    return out


def model_config(  # noqa: ANN201
    tok,  # noqa: ANN001
    arch: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    reward: bool = False,
    max_positions: int = 2048,
):
    """The transformers config of init_model's model for tokenizer `tok`."""
    from transformers import AutoConfig

    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be a multiple of heads, and heads a multiple of kv_heads")
    return AutoConfig.for_model(
        arch,
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=not reward,
        num_labels=1,
    )
