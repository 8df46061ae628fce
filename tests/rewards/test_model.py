"""The reward-model scorer reads the score at the last real token, whatever the padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_batch.errors import ModelError
from rlhf_batch.models.tiny import init_model
from rlhf_batch.rewards.model import RewardModel

SEQS = [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56], [60, 61, 62, 63, 0]]  # no pad id (1) inside


def hf_last_token_score(rm: RewardModel, seq: list[int]) -> float:
    """Hugging Face's own pooling on one unpadded sequence with no pad id set: the last token."""
    pad = rm.model.config.pad_token_id
    rm.model.config.pad_token_id = None
    try:
        with torch.no_grad():
            return rm.model(input_ids=torch.tensor([seq])).logits[0, 0].item()
    finally:
        rm.model.config.pad_token_id = pad


def test_a_padded_batch_scores_each_row_as_if_alone(tiny_reward_model: Path) -> None:
    rm = RewardModel(str(tiny_reward_model), dtype="float32")
    batch = rm.end_scores(SEQS)  # right-padded to 7 tokens
    for i, seq in enumerate(SEQS):
        assert batch[i].item() == pytest.approx(hf_last_token_score(rm, seq), abs=1e-5)
        assert batch[i].item() == pytest.approx(rm.end_scores([seq])[0].item(), abs=1e-5)
    budgeted = rm.scores(SEQS, max_tokens=8)  # batches of one or two rows, original order restored
    assert budgeted.tolist() == pytest.approx(batch.tolist(), abs=1e-5)


def test_pad_equal_to_eos_still_scores_the_final_eos_token(tmp_path: Path) -> None:
    path = init_model(tmp_path / "rm_eos", reward=True, pad="eos", seed=2)
    rm = RewardModel(str(path), dtype="float32")
    assert rm.pad_id == 0  # EOS: the third sequence ends with it
    got = rm.end_scores(SEQS)
    want = hf_last_token_score(rm, SEQS[2])
    assert got[2].item() == pytest.approx(want, abs=1e-5)
    with torch.no_grad():  # HF pooling with pad id = EOS would read the token before the EOS instead
        hf_default = rm.model(input_ids=torch.tensor([SEQS[2]])).logits[0, 0].item()
    assert abs(hf_default - want) > 1e-4


def test_a_causal_lm_is_not_a_reward_model(tiny_model: Path) -> None:
    with pytest.raises(ModelError, match="is not a sequence-classification model"):
        RewardModel(str(tiny_model), dtype="float32")
