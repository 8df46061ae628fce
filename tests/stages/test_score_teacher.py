"""score.teacher_model: the teacher's log-probs of every sampled token, beside the reference's,
on real Parquet rollouts and real tiny models (the rollouts of tests/stages/test_score.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlhf_batch.errors import ModelError
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.models.tiny import init_model
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import SCORES
from tests.stages.test_score import by_id, write_rollouts


def scores(cfg) -> list[dict]:  # noqa: ANN001
    sdir = layout.folder(cfg.run_dir, 0, "scores")
    return manifests.read_complete(sdir, SCORES).to_pylist()


def test_a_copy_of_the_policy_as_teacher_gives_the_behaviour_logprobs(
    make_config, tiny_model: Path, tmp_path
) -> None:
    teacher = shutil.copytree(tiny_model, tmp_path / "teacher")
    _, cfg = make_config(score={"teacher_model": str(teacher)})
    rows = by_id(write_rollouts(cfg))
    run_stage("score", cfg, 0, quiet=True)
    got = scores(cfg)
    assert len(got) == 12
    for r in got:  # the same weights: the same log-probs up to KV-cache vs full-forward rounding
        beh = rows[r["rollout_id"]]["behavior_logprobs"]
        assert len(r["teacher_logprobs"]) == len(beh)
        assert max(abs(a - b) for a, b in zip(r["teacher_logprobs"], beh, strict=True)) < 1e-5
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "scores"))
    assert m["config"]["score"]["teacher_model"] == str(teacher) and "teacher_model" in m["inputs"]


def test_another_teacher_gives_its_own_forward(make_config, tmp_path) -> None:
    teacher = init_model(tmp_path / "teacher", arch="qwen2", seed=5)  # same tokenizer, other weights
    _, cfg = make_config(score={"teacher_model": str(teacher)})
    rows = write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    model = load_model(str(teacher), "teacher", dtype="float32")
    got = by_id(scores(cfg))
    for row in rows:
        seq = row["prompt_ids"] + row["response_ids"]
        with torch.no_grad():
            lp, _, _ = response_logprobs(model, [seq], [len(row["prompt_ids"])], 1.0, pad_id=1)
        teacher_lp = got[row["rollout_id"]]["teacher_logprobs"]
        assert teacher_lp == pytest.approx(lp[0].tolist(), abs=1e-5)
        # another model: its log-probs differ from the behaviour ones
        assert max(abs(a - b) for a, b in zip(teacher_lp, row["behavior_logprobs"], strict=True)) > 1e-3


def test_no_teacher_no_column_and_the_identity_as_before(make_config) -> None:
    _, cfg = make_config()
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    assert "teacher_logprobs" not in scores(cfg)[0]
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "scores"))
    assert "teacher_model" not in m["config"]["score"] and "teacher_model" not in m["inputs"]


def test_a_teacher_with_another_tokenizer_is_one_line_and_writes_nothing(make_config, tmp_path) -> None:
    other = init_model(tmp_path / "big_vocab", vocab_size=128)
    _, cfg = make_config(score={"teacher_model": str(other)})
    write_rollouts(cfg)
    with pytest.raises(
        ModelError, match=r"^score.teacher_model: the tokenizer of .* differs from the policy's"
    ) as e:
        run_stage("score", cfg, 0, quiet=True)
    assert "\n" not in str(e.value)
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "scores")) is None
    assert not list(layout.folder(cfg.run_dir, 0, "scores").glob("part-*.parquet"))
