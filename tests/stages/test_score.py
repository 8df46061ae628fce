"""The score stage on real Parquet rollouts and real tiny models.

Rollouts are written here through executor.claim (not by generate): 3 prompts x 4 fixed
responses, behaviour log-probs from a plain forward pass of the tiny policy, optionally shifted
by `delta` per token to play a policy that is more (or less) likely than the reference.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rlhf_batch.errors import ConfigError, ModelError, RewardError, SchemaError, StageError
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.models.tiny import init_model
from rlhf_batch.runtime import faults
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests, output
from rlhf_batch.store.schemas import ROLLOUTS, SCORES, with_extra

PROMPTS = [("p0", "a*2=", "a", 2), ("p1", "b*3=", "b", 3), ("p2", "c*1=", "c", 1)]
RESPONSES = ("{l}{l}", "x{l}", "{l}{l}{l}", "zz")  # sample j's response; {l} = the prompt's letter
EQUAL_LENGTHS = ("{l}{l}", "x{l}", "{l}z", "zz")  # 2 characters + EOS = 3 tokens each
HERE = "tests.stages.test_score"
FAIL_ON: set[tuple[str, str]] = set()  # (prompt, response) pairs `flaky_reward` raises on


@pytest.fixture
def make_config(make_config):  # noqa: ANN001, ANN201
    """These tests exercise KL in the reward: on unless a test says otherwise (the default is off)."""

    def make(extra: str = "", name: str = "config.toml", **top: object):  # noqa: ANN202
        score = {"kl_in_reward": True, **top.pop("score", {})}  # type: ignore[dict-item]
        return make_config(extra, name, score=score, **top)

    return make


def length_reward(*, responses: list[str], **_: object) -> list[float]:
    return [float(len(r)) for r in responses]


def token_reward(*, prompt_ids: list[list[int]], response_ids: list[list[int]], **_: object) -> list[float]:
    return [float(sum(p) + 1000 * len(r)) for p, r in zip(prompt_ids, response_ids, strict=True)]


def none_for_b(*, prompts: list[str], **_: object) -> list[float | None]:
    return [None if p.startswith("b") else 1.0 for p in prompts]


def flaky_reward(*, prompts: list[str], responses: list[str], **_: object) -> list[float]:
    if any((p, r) in FAIL_ON for p, r in zip(prompts, responses, strict=True)):
        raise ValueError("cannot parse")
    return [1.0] * len(prompts)


def big_reward(*, letter: list[str], **_: object) -> list[float]:
    return [{"a": 5.0, "b": -7.0, "c": 0.5}[c] for c in letter]


def write_rollouts(
    cfg, it=0, *, policy=None, delta=0.0, responses=RESPONSES, edit=None, per_part=5
) -> list[dict]:
    """12 rollouts (3 prompts x 4 responses) in iter=`it`/rollouts; returns the rows."""
    tok = load_tokenizer(cfg.policy_model)
    model = load_model(cfg.policy_model, "policy", dtype="float32")
    rows = []
    for pid, prompt, letter, count in PROMPTS:
        for j, fmt in enumerate(responses):
            text = fmt.format(l=letter)
            p_ids = tok(prompt)["input_ids"]
            r_ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            with torch.no_grad():
                lp, _, _ = response_logprobs(
                    model, [p_ids + r_ids], [len(p_ids)], cfg.generate.temperature, pad_id=1
                )
            rows.append(
                {
                    "rollout_id": f"{it:04d}-{pid}-{j}",
                    "prompt_id": pid,
                    "sample_idx": j,
                    "prompt": prompt,
                    "prompt_ids": p_ids,
                    "response": text,
                    "response_ids": r_ids,
                    "behavior_logprobs": [x + delta for x in lp[0].tolist()],
                    "finish_reason": "stop",
                    "policy": policy or cfg.policy_model,
                    "letter": letter,
                    "count": count,
                }
            )
    if edit:
        edit(rows)
    schema = with_extra(ROLLOUTS, pa.schema([("letter", pa.string()), ("count", pa.int64())]))
    stage = output.claim(layout.folder(cfg.run_dir, it, "rollouts"), "rollouts", {"test": True}, {}, True)
    n_parts = math.ceil(len(rows) / per_part)
    for n in range(n_parts):
        stage.write_table(
            n, pa.Table.from_pylist(rows[n * per_part : (n + 1) * per_part], schema=schema), schema
        )
    stage.finish(n_parts)
    return rows


def scores(cfg, it=0) -> list[dict]:
    return manifests.read_complete(layout.folder(cfg.run_dir, it, "scores"), SCORES).to_pylist()


def by_id(rows: list[dict]) -> dict[str, dict]:
    return {r["rollout_id"]: r for r in rows}


@pytest.fixture
def policy_copy(tiny_model: Path, tmp_path: Path) -> str:
    """The same weights under another path: the reference forward runs instead of being skipped."""
    return str(shutil.copytree(tiny_model, tmp_path / "ref_copy"))


# --- rewards ---------------------------------------------------------------------------------


def test_reward_functions_receive_each_rollouts_token_ids(make_config) -> None:
    _, cfg = make_config(score={"reward_functions": [f"{HERE}:token_reward"], "rows_per_part": 5})
    rows = write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    got = by_id(scores(cfg))
    for r in rows:  # the ids as written to the rollouts table, row by row
        expected = sum(r["prompt_ids"]) + 1000 * len(r["response_ids"])
        assert got[r["rollout_id"]]["reward_token_reward"] == expected


def test_reward_functions_by_import_path_with_weights(make_config) -> None:
    _, cfg = make_config(
        score={
            "reward_functions": ["rlhf_batch.rewards.demo:letter_count", f"{HERE}:length_reward"],
            "reward_weights": [2.0, -0.5],
        }
    )
    write_rollouts(cfg)
    m = run_stage("score", cfg, 0, quiet=True)
    got = by_id(scores(cfg))
    # reward_raw = 2 * letter_count - 0.5 * len(response); letter_count = right letters among the
    # first N / max(N, len): a*2= "aa" 2/2, "xa" 1/2, "aaa" 2/3; b*3= "bb" 2/3, "bbb" 3/3; c*1= "cc" 1/2
    expected = {
        "0000-p0-0": 2 * 1.0 - 1.0,
        "0000-p0-1": 2 * 0.5 - 1.0,
        "0000-p0-2": 2 * 2 / 3 - 1.5,
        "0000-p0-3": 0.0 - 1.0,
        "0000-p1-0": 2 * 2 / 3 - 1.0,
        "0000-p1-2": 2 * 1.0 - 1.5,
        "0000-p2-0": 2 * 0.5 - 1.0,
        "0000-p2-1": 0.0 - 1.0,
        "0000-p2-2": 2 * 1 / 3 - 1.5,
    }
    for rid, raw in expected.items():
        assert got[rid]["reward_raw"] == pytest.approx(raw, abs=1e-12)
        assert got[rid]["score"] == got[rid]["reward"] == got[rid]["reward_raw"]  # no clip, kl exactly 0
    assert got["0000-p0-2"]["reward_letter_count"] == pytest.approx(2 / 3)
    assert got["0000-p0-2"]["reward_length_reward"] == 3.0
    assert m["rows"] == 12 and m["counts"]["unscored"] == 0


def test_none_is_recorded_excluded_and_counted(make_config) -> None:
    _, cfg = make_config(
        score={"reward_functions": ["rlhf_batch.rewards.demo:letter_count", f"{HERE}:none_for_b"]}
    )
    write_rollouts(cfg)
    m = run_stage("score", cfg, 0, quiet=True)
    for r in scores(cfg):
        is_b = r["prompt_id"] == "p1"
        assert (r["reward_none_for_b"] is None) == is_b
        assert (r["reward_raw"] is None) == (r["score"] is None) == (r["reward"] is None) == is_b
        assert r["kl_sum"] == 0.0  # KL is still there for the unscored rows
    assert m["counts"]["unscored"] == m["counts"]["unscored_reward_none_for_b"] == 4  # 4 samples of p1
    assert m["counts"]["unscored_reward_letter_count"] == 0


def test_a_raising_function_names_itself_and_the_rollout_and_keeps_written_parts(make_config) -> None:
    _, cfg = make_config(score={"reward_functions": [f"{HERE}:flaky_reward"], "rows_per_part": 4})
    write_rollouts(cfg)
    sdir = layout.folder(cfg.run_dir, 0, "scores")
    FAIL_ON.add(("c*1=", "xc"))  # rollout 0000-p2-1, in part 2 (rows 8..11)
    try:
        with pytest.raises(
            RewardError, match=rf"{HERE}:flaky_reward raised ValueError: cannot parse \(rollout 0000-p2-1\)"
        ):
            run_stage("score", cfg, 0, quiet=True)
    finally:
        FAIL_ON.clear()
    written = {p.name: p.stat().st_mtime_ns for p in layout.list_parts(sdir)}
    assert (
        sorted(written) == [layout.part_name(0, 0), layout.part_name(0, 1)]
        and manifests.manifest(sdir) is None
    )
    m = run_stage("score", cfg, 0, quiet=True)  # the function is fixed: the re-run only writes part 2
    assert m["rows"] == 12
    assert {p.name: p.stat().st_mtime_ns for p in layout.list_parts(sdir)}.items() >= written.items()


def test_score_clip_clips_the_score_not_reward_raw(make_config) -> None:
    _, cfg = make_config(score={"reward_functions": [f"{HERE}:big_reward"], "score_clip": 2.0})
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    for r in scores(cfg):
        raw, clipped = {"p0": (5.0, 2.0), "p1": (-7.0, -2.0), "p2": (0.5, 0.5)}[
            r["prompt_id"]
        ]  # clip to [-2, 2]
        assert (r["reward_raw"], r["score"], r["reward"]) == (raw, clipped, clipped)


def test_reward_model_score_is_weighted_into_reward_raw(make_config, tiny_reward_model: Path) -> None:
    _, cfg = make_config(reward_model=str(tiny_reward_model), score={"reward_model_weight": 0.5})
    rows = by_id(write_rollouts(cfg))
    m = run_stage("score", cfg, 0, quiet=True)
    hf = load_model(str(tiny_reward_model), "rm", kind="reward", dtype="float32")
    for r in scores(cfg):
        seq = (
            rows[r["rollout_id"]]["prompt_ids"] + rows[r["rollout_id"]]["response_ids"]
        )  # no pad id (1) inside
        with torch.no_grad():
            alone = hf(input_ids=torch.tensor([seq])).logits[0, 0].item()  # HF pools at the last token
        assert r["rm_score"] == pytest.approx(alone, abs=1e-5)
        assert r["reward_raw"] == pytest.approx(r["reward_letter_count"] + 0.5 * r["rm_score"], abs=1e-12)
    assert m["counts"]["unscored_rm_score"] == 0


def test_progress_bar_counts_every_token_each_model_reads_unless_quiet(
    make_config, tiny_reward_model: Path, policy_copy: str, capsys
) -> None:
    _, cfg = make_config(reward_model=str(tiny_reward_model), ref_model=policy_copy)
    rows = write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=False)
    err = capsys.readouterr().err
    # the reference and the reward model each read every prompt + response token once
    tokens = 2 * sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    assert re.search(rf"score: done {tokens}/{tokens} tok in .*tok/s\)", err), err  # stderr is no tty
    run_stage("score", cfg, 0, quiet=True, force=True)
    assert capsys.readouterr().err == ""


# --- reference log-probs and KL ---------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_is_exactly_zero_when_the_reference_is_the_policy_itself(make_config, estimator: str) -> None:
    _, cfg = make_config(score={"kl_estimator": estimator})
    rows = by_id(write_rollouts(cfg))  # policy column == policy_model == the reference
    run_stage("score", cfg, 0, quiet=True)
    for r in scores(cfg):
        assert r["ref_logprobs"] == rows[r["rollout_id"]]["behavior_logprobs"]
        assert r["kl"] == [0.0] * len(r["ref_logprobs"]) and r["kl_sum"] == 0.0
        assert r["reward"] == r["score"]


def test_same_weights_under_another_path_recompute_to_within_1e_5(make_config, policy_copy: str) -> None:
    _, cfg = make_config(ref_model=policy_copy)
    rows = by_id(write_rollouts(cfg))
    run_stage("score", cfg, 0, quiet=True)
    for r in scores(cfg):
        beh = rows[r["rollout_id"]]["behavior_logprobs"]
        assert max(abs(a - b) for a, b in zip(r["ref_logprobs"], beh, strict=True)) < 1e-5
        assert max(abs(k) for k in r["kl"]) < 1e-5


@pytest.mark.parametrize(
    ("estimator", "delta", "per_token"),
    [
        ("k1", 0.25, 0.25),  # logp - ref = +0.25
        ("k1", -0.25, -0.25),
        ("k2", 0.25, 0.5 * 0.25**2),  # 0.03125
        ("k3", 0.25, math.exp(-0.25) + 0.25 - 1),  # d = ref - logp = -0.25: e^d - d - 1 = 0.0288008
        ("k3", -0.25, math.exp(0.25) - 0.25 - 1),  # d = +0.25: 0.0340254
    ],
)
def test_kl_sign_and_estimators(make_config, estimator: str, delta: float, per_token: float) -> None:
    _, cfg = make_config(score={"kl_estimator": estimator, "kl_reward_coef": 0.1})
    write_rollouts(cfg, policy="some/other/policy", delta=delta)  # behaviour = reference + delta per token
    run_stage("score", cfg, 0, quiet=True)
    for r in scores(cfg):
        n = len(r["kl"])  # 3 or 4 tokens
        assert r["kl"] == pytest.approx([per_token] * n, abs=1e-5)
        assert r["kl_sum"] == pytest.approx(per_token * n, abs=4e-5)
        assert r["kl_coef"] == 0.1
        assert r["reward"] == pytest.approx(r["score"] - 0.1 * per_token * n, abs=1e-5)
        if estimator == "k1":  # the policy more likely than the reference -> the reward goes down
            assert (r["reward"] < r["score"]) == (delta > 0)


def test_kl_out_of_the_reward_but_in_the_loss_keeps_kl_and_sets_kl_coef_0(make_config) -> None:
    _, cfg = make_config(score={"kl_in_reward": False}, train={"kl_loss_coef": 0.1})
    write_rollouts(cfg, policy="other", delta=0.25)
    run_stage("score", cfg, 0, quiet=True)
    for r in scores(cfg):
        assert r["kl_coef"] == 0.0 and r["reward"] == r["score"] and r["kl_sum"] > 0.7  # 3+ tokens x 0.25


@pytest.mark.parametrize("no_kl", [{"kl_in_reward": False}, {"kl_reward_coef": 0.0}])
def test_no_reference_forward_when_no_kl_is_used(
    make_config, tiny_model: Path, tmp_path: Path, no_kl
) -> None:
    # The reference: the policy's config and tokenizer with unreadable weights, so any attempt to
    # load it (for a forward pass) fails; rollouts of another policy would need that forward.
    ref = shutil.copytree(tiny_model, tmp_path / "ref_without_weights")
    for w in ref.glob("*.safetensors"):
        w.write_bytes(b"not safetensors")
    _, cfg = make_config(score=no_kl, ref_model=str(ref))
    write_rollouts(cfg, policy="other", delta=0.25)
    m = run_stage("score", cfg, 0, quiet=True)
    rows = scores(cfg)
    assert len(rows) == 12
    for r in rows:
        assert r["ref_logprobs"] is None and r["kl"] is None and r["kl_sum"] is None
        assert r["kl_coef"] == 0.0 and r["reward"] == r["score"] is not None
    assert m["mean_kl_sum"] is None and m["kl_coef"] == 0.0
    # the same rollouts with KL in the reward do need the reference's weights
    _, with_kl = make_config(
        score={"kl_reward_coef": 0.1}, ref_model=str(ref), run_dir=str(tmp_path / "kl"), name="kl.toml"
    )
    write_rollouts(with_kl, policy="other", delta=0.25)
    with pytest.raises(Exception, match="safetensors|header|deserializ"):
        run_stage("score", with_kl, 0, quiet=True)


def test_adaptive_controller_beta_carries_from_iteration_to_iteration(make_config) -> None:
    extra = {"kl_controller": "adaptive", "kl_reward_coef": 0.1, "kl_target": 1.0, "kl_horizon": 100}
    _, cfg = make_config(score=extra)
    for it in (0, 1):
        write_rollouts(cfg, it, policy="other", delta=0.5, responses=EQUAL_LENGTHS)  # kl_sum = 3 x 0.5 = 1.5
    with pytest.raises(StageError, match="score that iteration first"):
        run_stage("score", cfg, 1, quiet=True)
    m0 = run_stage("score", cfg, 0, quiet=True)
    assert {r["kl_coef"] for r in scores(cfg, 0)} == {0.1}
    # error = clip(1.5 / 1.0 - 1, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 12 rollouts / 100) = 0.1024
    assert m0["mean_kl_sum"] == pytest.approx(1.5, abs=1e-5)
    assert m0["kl_controller"]["beta"] == pytest.approx(0.1024, rel=1e-12)
    run_stage("score", cfg, 1, quiet=True)
    for r in scores(cfg, 1):
        assert r["kl_coef"] == pytest.approx(0.1024, rel=1e-12)
        assert r["reward"] == pytest.approx(r["score"] - 0.1024 * r["kl_sum"], abs=1e-12)
    run_stage("score", cfg, 1, force=True, quiet=True)  # a re-run sees the same beta
    assert [r["kl_coef"] for r in scores(cfg, 1)] == pytest.approx([0.1024] * 12, rel=1e-12)
    assert manifests.manifest(layout.folder(cfg.run_dir, 1, "scores"))["kl_controller"][
        "beta"
    ] == pytest.approx(0.1024 * 1.024, rel=1e-12)  # updated once more with the same KL


def test_constant_controller_keeps_kl_coef(make_config) -> None:
    _, cfg = make_config(score={"kl_reward_coef": 0.2})
    for it in (0, 1):
        write_rollouts(cfg, it, policy="other", delta=0.5)
        run_stage("score", cfg, it, quiet=True)
        assert {r["kl_coef"] for r in scores(cfg, it)} == {0.2}


# --- batching, resume, re-scoring ---------------------------------------------------------------


def test_results_do_not_depend_on_the_token_budget_or_part_size(
    make_config, policy_copy: str, tmp_path
) -> None:
    _, a = make_config(ref_model=policy_copy, score={"max_tokens_per_batch": 4096, "rows_per_part": 12})
    _, b = make_config(
        name="b.toml",
        run_dir=str(tmp_path / "b"),
        ref_model=policy_copy,
        score={"max_tokens_per_batch": 7, "rows_per_part": 5},
    )  # 7 tokens: one row per batch
    rows = write_rollouts(a)
    write_rollouts(b)
    run_stage("score", a, 0, quiet=True)
    run_stage("score", b, 0, quiet=True)
    sa, sb = scores(a), scores(b)
    assert [r["rollout_id"] for r in sa] == [r["rollout_id"] for r in sb] == [r["rollout_id"] for r in rows]
    for ra, rb in zip(sa, sb, strict=True):
        assert ra["reward_raw"] == rb["reward_raw"]
        assert ra["ref_logprobs"] == pytest.approx(rb["ref_logprobs"], abs=1e-5)
        assert ra["reward"] == pytest.approx(rb["reward"], abs=1e-6)


def test_resume_after_sigkill_gives_the_rows_of_an_uninterrupted_run(
    make_config, policy_copy: str, tmp_path
) -> None:
    path, cfg = make_config(ref_model=policy_copy, score={"rows_per_part": 2})
    _, clean = make_config(
        name="clean.toml", run_dir=str(tmp_path / "clean"), ref_model=policy_copy, score={"rows_per_part": 2}
    )
    write_rollouts(cfg)
    write_rollouts(clean)
    sdir = layout.folder(cfg.run_dir, 0, "scores")
    env = {**os.environ, faults.FAULT_ENV: "scores:part-2:done"}  # SIGKILL right after part 2 of 6 is written
    killed = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "score", str(path), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -9, killed.stderr
    assert [layout.part_number(p) for p in layout.list_parts(sdir)] == [0, 1, 2]
    assert manifests.manifest(sdir) is None
    m = run_stage("score", cfg, 0, quiet=True)
    run_stage("score", clean, 0, quiet=True)
    assert m["rows"] == 12 and len(m["parts"]) == 6
    assert scores(cfg) == scores(clean)


def test_rescoring_needs_force_and_leaves_rollouts_alone(make_config) -> None:
    _, cfg = make_config()
    write_rollouts(cfg)
    m = run_stage("score", cfg, 0, quiet=True)
    sdir = layout.folder(cfg.run_dir, 0, "scores")
    mtimes = {p: p.stat().st_mtime_ns for p in layout.list_parts(sdir)}
    assert run_stage("score", cfg, 0, quiet=True) == m  # complete: nothing is redone
    cfg.score.max_tokens_per_batch = 7  # a batching knob is not a reason to re-score
    assert run_stage("score", cfg, 0, quiet=True) == m
    assert {p: p.stat().st_mtime_ns for p in layout.list_parts(sdir)} == mtimes
    rdir = layout.folder(cfg.run_dir, 0, "rollouts")
    before = manifests.file_fingerprint(rdir)
    cfg.score.reward_functions = [f"{HERE}:length_reward"]
    with pytest.raises(StageError, match="--force"):
        run_stage("score", cfg, 0, quiet=True)
    run_stage("score", cfg, 0, force=True, quiet=True)
    assert "reward_length_reward" in scores(cfg)[0] and "reward_letter_count" not in scores(cfg)[0]
    assert manifests.file_fingerprint(rdir) == before


# --- checks ---------------------------------------------------------------------------------------


def _shorten(rows):
    rows[5]["behavior_logprobs"].pop()


def _oov(rows):
    rows[2]["response_ids"][0] = 5000


def _nan(rows):
    rows[7]["behavior_logprobs"][1] = float("nan")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_shorten, "rollout 0000-p1-1 has behavior_logprobs of another length than its response_ids"),
        (_oov, "rollout 0000-p0-2 has token id 5000 in response_ids, outside the model vocabulary"),
        (_nan, "rollout 0000-p1-3 has a NaN or inf behavior log-prob"),
    ],
)
def test_bad_rollouts_are_refused_naming_the_rollout(make_config, edit, message: str) -> None:
    _, cfg = make_config()
    write_rollouts(cfg, edit=edit)
    with pytest.raises(SchemaError, match=message):
        run_stage("score", cfg, 0, quiet=True)


def test_a_reference_model_with_another_vocabulary_is_refused(make_config, tmp_path) -> None:
    # (a reward model with another vocabulary re-tokenises: tests/rewards/test_reward_model_tokenizer.py)
    other = init_model(tmp_path / "big_vocab", vocab_size=128)
    _, cfg = make_config(ref_model=str(other))
    write_rollouts(cfg)
    with pytest.raises(
        ModelError,
        match=r"the tokenizers of the policy \(.*\) and of the reference model .* have different vocabularies",
    ):
        run_stage("score", cfg, 0, quiet=True)


def test_missing_rollouts_and_missing_rewards_are_errors(make_config) -> None:
    _, cfg = make_config()
    with pytest.raises(StageError, match="rollouts are not complete"):
        run_stage("score", cfg, 0, quiet=True)
    cfg.score.reward_functions = []
    with pytest.raises(
        ConfigError, match="reward_model and/or score.judge_model; nothing would give a reward"
    ):
        run_stage("score", cfg, 0, quiet=True)
