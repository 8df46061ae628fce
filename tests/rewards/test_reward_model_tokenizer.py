"""A reward model with another tokenizer reads the decoded text re-tokenised with its own
tokenizer (and chat template); one with the policy's vocabulary reads the token ids as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from rlhf_batch.models.load import load_tokenizer
from rlhf_batch.models.tiny import init_model
from rlhf_batch.rewards.model import RewardModel
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS, SCORES


def permuted_reward_model(path: Path, chat_template: bool = True) -> Path:
    """A tiny reward model whose tokenizer gives the printable characters other ids (reversed
    order): same size, another vocabulary."""
    init_model(path, reward=True, seed=3)
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    chars = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 5]  # after the 5 specials
    ids = sorted(vocab[t] for t in chars)
    for t, i in zip(chars, reversed(ids), strict=True):
        vocab[t] = i
    (path / "tokenizer.json").write_text(json.dumps(data))
    if not chat_template:
        (path / "chat_template.jinja").unlink()
    return path


@pytest.fixture
def perm_rm(tmp_path: Path) -> Path:
    return permuted_reward_model(tmp_path / "rm_perm")


def test_another_vocabulary_re_tokenises_text_and_chat(
    perm_rm: Path, tiny_model: Path, tmp_path: Path
) -> None:
    policy_tok = load_tokenizer(str(tiny_model))
    rm = RewardModel(str(perm_rm), dtype="float32", policy_tokenizer=policy_tok)
    assert not rm.same_vocab
    own = load_tokenizer(str(perm_rm))
    assert own("a")["input_ids"] != policy_tok("a")["input_ids"]  # the permutation took
    text = pa.table({"prompt": ["c*3="], "response": ["ccc"]})
    assert rm.sequences(text, [[9]], [[9]]) == [own("c*3=ccc", add_special_tokens=False)["input_ids"]]
    chat = pa.table(
        {
            "prompt": ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"],
            "response": ["ok"],
            "prompt_messages": [[{"role": "user", "content": "hi"}]],
        }
    )
    # the reward model's own template over the messages plus the response as the assistant turn
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    assert rm.sequences(chat, [[9]], [[9]]) == [own(want, add_special_tokens=False)["input_ids"]]
    # without a chat template: the rendered prompt text followed by the response
    plain = RewardModel(
        str(permuted_reward_model(tmp_path / "rm_plain", chat_template=False)),
        dtype="float32",
        policy_tokenizer=policy_tok,
    )
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok"
    assert plain.sequences(chat, [[9]], [[9]]) == [own(want, add_special_tokens=False)["input_ids"]]


def test_the_same_vocabulary_reads_the_token_ids(tiny_reward_model: Path, tiny_model: Path) -> None:
    rm = RewardModel(
        str(tiny_reward_model), dtype="float32", policy_tokenizer=load_tokenizer(str(tiny_model))
    )
    assert rm.same_vocab
    t = pa.table({"prompt": ["not read"], "response": ["not read"]})
    assert rm.sequences(t, [[40, 41]], [[42, 0]]) == [[40, 41, 42, 0]]


def test_score_stage_with_a_reward_model_of_another_tokenizer(make_config, perm_rm: Path) -> None:
    _, cfg = make_config(reward_model=str(perm_rm), generate={"num_generations": 2})
    run_stage("generate", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, quiet=True)
    rollouts = manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS).to_pylist()
    got = manifests.read_complete(layout.folder(cfg.run_dir, 0, "scores"), SCORES)["rm_score"].to_pylist()
    rm, own = RewardModel(str(perm_rm), dtype="float32"), load_tokenizer(str(perm_rm))
    for r, g in zip(rollouts, got, strict=True):  # each row alone, tokenised here by hand
        ids = own(r["prompt"] + r["response"], add_special_tokens=False)["input_ids"]
        assert g == pytest.approx(rm.end_scores([ids])[0].item(), abs=1e-5)
