"""score.judge_model: an LLM judge as a reward, on real Parquet rollouts and a real tiny causal LM.

A tiny model with random weights cannot grade anything, so its judgement is made deterministic
by the test's own parsers of its greedy output; the verdict itself is checked against
transformers' own greedy `generate` on the prompt the test renders by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_batch.errors import ConfigError
from rlhf_batch.models.load import load_model, load_tokenizer
from rlhf_batch.models.tiny import init_model
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import SCORES
from tests.stages.test_score import PROMPTS, RESPONSES, by_id, write_rollouts

HERE = "tests.stages.test_score_judge"
MAX_NEW = 8


def verdict_length(verdict: str) -> float | None:
    """A fixed parser: the verdict's length, None when it is odd."""
    return None if len(verdict) % 2 else float(len(verdict))


def group_places(verdict: str, n: int) -> list[float]:
    """A fixed group parser: response k (1-based) gets 100 * k + the verdict's length."""
    return [100.0 * k + len(verdict) for k in range(1, n + 1)]


def greedy(model_dir: Path, text: str) -> str:
    """transformers' own greedy decoding of `text` as one user message (the judge's input)."""
    tok = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir), "judge", dtype="float32")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok(chat, add_special_tokens=False)["input_ids"]])
    end = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=end,
            pad_token_id=1,
        )
    return str(tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True))


def scored(cfg) -> list[dict]:  # noqa: ANN001
    return manifests.read_complete(layout.folder(cfg.run_dir, 0, "scores"), SCORES).to_pylist()


def judge_config(make_config, judge: Path, **score: object):  # noqa: ANN001, ANN201
    base = {"judge_model": str(judge), "judge_max_new_tokens": MAX_NEW, "reward_functions": []}
    return make_config(score={**base, **score})[1]


def sharp_model(out: Path, seed: int, **shape: int) -> Path:
    """A tiny causal LM whose weights are 10x a fresh draw's: at the usual scale its greedy output
    is the same for every input (newlines), here it depends on the input, as a judge's must."""
    init_model(out, arch="qwen2", seed=seed, **shape)
    model = load_model(str(out), "judge", dtype="float32")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(10.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_model(tmp_path_factory.mktemp("models") / "judge", seed=7)


def test_pointwise_verdicts_are_the_judges_greedy_output_and_enter_the_reward(
    make_config, judge_model: Path
) -> None:
    cfg = judge_config(
        make_config,
        judge_model,
        judge_template="Is {response} right for {letter}?",
        judge_parser=f"{HERE}:verdict_length",
        judge_weight=0.5,
    )
    rows = by_id(write_rollouts(cfg))
    run_stage("score", cfg, 0, quiet=True)
    got = scored(cfg)
    assert len(got) == 12
    unparsed, verdicts = 0, set()
    for r in got:
        src = rows[r["rollout_id"]]
        verdict = greedy(judge_model, f"Is {src['response']} right for {src['letter']}?")
        assert r["judge_verdict"] == verdict
        verdicts.add(verdict)
        expected = None if len(verdict) % 2 else float(len(verdict))
        unparsed += expected is None
        assert r["judge_score"] == expected
        # the judge is the only reward: reward_raw = 0.5 x its score (null with it)
        assert r["reward_raw"] == (None if expected is None else 0.5 * expected)
    assert len(verdicts) >= 6 and 0 < unparsed < 12  # the verdicts depend on the rollout
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "scores"))
    assert m["counts"]["judge_unparsed"] == unparsed
    assert m["counts"]["unscored"] == unparsed
    assert "judge_model" in m["inputs"] and m["config"]["score"]["judge_parser"] == f"{HERE}:verdict_length"


def test_a_verdict_without_a_score_is_null_and_counted_never_a_failure(
    make_config, judge_model: Path
) -> None:
    cfg = judge_config(make_config, judge_model, judge_pattern=r"NEVER SAID (\d+)")
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    got = scored(cfg)
    assert [r["judge_score"] for r in got] == [None] * 12
    assert all(isinstance(r["judge_verdict"], str) for r in got)
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "scores"))
    assert m["counts"]["judge_unparsed"] == 12 and m["counts"]["unscored"] == 12


def test_group_mode_shows_the_judge_each_prompts_responses_together(make_config, judge_model: Path) -> None:
    cfg = judge_config(
        make_config,
        judge_model,
        judge_mode="group",
        judge_template="{prompt}|{responses}",
        judge_parser=f"{HERE}:group_places",
    )
    rows = write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    got = by_id(scored(cfg))
    for pid, prompt, letter, _ in PROMPTS:
        block = "\n\n".join(f"Response {k}:\n{fmt.format(l=letter)}" for k, fmt in enumerate(RESPONSES, 1))
        verdict = greedy(judge_model, f"{prompt}|{block}")
        group = [r for r in rows if r["prompt_id"] == pid]
        assert len(group) == 4
        for k, row in enumerate(group, start=1):  # rollouts order: sample k is response k
            assert got[row["rollout_id"]]["judge_verdict"] == verdict
            assert got[row["rollout_id"]]["judge_score"] == 100.0 * k + len(verdict)


def test_cached_verdicts_are_read_back_by_their_key(make_config, judge_model: Path) -> None:
    cfg = judge_config(make_config, judge_model, judge_parser=f"{HERE}:verdict_length", reward_cache=True)
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    first = by_id(scored(cfg))
    files = sorted((Path(cfg.run_dir) / layout.REWARD_CACHE / "judge").glob("*/part-*.parquet"))
    assert len(files) == 1
    cached = pq.read_table(files[0])
    assert cached.num_rows == 12
    # an edited verdict in the cache is what a re-score reads: the key reaches the cache
    pq.write_table(cached.set_column(1, "value", pa.array([99.0] * 12, pa.float64())), files[0])
    run_stage("score", cfg, 0, quiet=True, force=True)
    again = by_id(scored(cfg))
    assert {r["judge_score"] for r in again.values()} == {99.0}
    assert {k: r["judge_verdict"] for k, r in again.items()} == {
        k: r["judge_verdict"] for k, r in first.items()
    }
    # another judge (other weights) has another identity: nothing of the first is reused
    other = sharp_model(Path(cfg.run_dir).parent / "judge2", seed=8)
    cfg2 = judge_config(make_config, other, judge_parser=f"{HERE}:verdict_length", reward_cache=True)
    run_stage("score", cfg2, 0, quiet=True, force=True)
    assert len(list((Path(cfg.run_dir) / layout.REWARD_CACHE / "judge").iterdir())) == 2
    assert 99.0 not in {r["judge_score"] for r in scored(cfg2)}


def test_bad_judge_settings_are_one_line_errors(make_config, judge_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config.toml: score.judge_pattern: not a regular expression"):
        make_config(score={"judge_model": str(judge_model), "judge_pattern": "score: (\\d"})
    with pytest.raises(ConfigError, match=r"score.judge_pattern: needs 2 group\(s\) in group mode, has 1"):
        make_config(score={"judge_model": str(judge_model), "judge_mode": "group", "judge_pattern": r"(\d+)"})
    with pytest.raises(ConfigError, match=r"'score.judge_parser' must be 'module:function'"):
        make_config(score={"judge_model": str(judge_model), "judge_parser": "not a function"})
    cfg = judge_config(make_config, judge_model, judge_template="{response} {nope}")
    write_rollouts(cfg)
    with pytest.raises(ConfigError, match=r"score.judge_template: no field \{nope\} in pointwise mode") as e:
        run_stage("score", cfg, 0, quiet=True)
    assert "\n" not in str(e.value)
    assert manifests.manifest(layout.folder(cfg.run_dir, 0, "scores")) is None


def test_without_a_judge_the_identity_has_no_judge_key(make_config) -> None:
    _, cfg = make_config()
    write_rollouts(cfg)
    run_stage("score", cfg, 0, quiet=True)
    m = manifests.manifest(layout.folder(cfg.run_dir, 0, "scores"))
    assert not [k for k in m["config"]["score"] if k.startswith("judge_")]
    assert "judge_model" not in m["inputs"] and "judge_unparsed" not in m["counts"]
    assert "judge_score" not in scored(cfg)[0]


@pytest.mark.slow
def test_the_judge_runs_on_the_vllm_engine_when_generate_uses_it(make_config, tmp_path: Path) -> None:
    from tests.engines.test_vllm import VLLM_PY, need_vllm

    need_vllm()
    # vLLM's CPU attention needs head_dim 64 (tests/engines/test_vllm.py)
    judge = sharp_model(tmp_path / "judge64", seed=3, hidden=128, heads=2, kv_heads=1)
    path, cfg = make_config(
        generate={"engine": "vllm", "python": str(VLLM_PY), "enforce_eager": True},
        score={
            "judge_model": str(judge),
            "judge_max_new_tokens": MAX_NEW,
            "judge_template": "Is {response} right for {letter}?",
            "judge_parser": "judge_parsers:verdict_length",
        },
    )
    # the parser beside the config (searched like reward modules): vLLM's venv has no pytest
    (tmp_path / "judge_parsers.py").write_text(
        "def verdict_length(verdict):\n    return None if len(verdict) % 2 else float(len(verdict))\n"
    )
    rows = by_id(write_rollouts(cfg))
    # the score command hands itself over to generate.python, where vLLM is installed
    cmd = [sys.executable, "-m", "rlhf_batch", "score", str(path), "--iter", "0", "--quiet"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    got = scored(cfg)
    assert len(got) == 12
    for r in got:
        src = rows[r["rollout_id"]]
        verdict = greedy(judge, f"Is {src['response']} right for {src['letter']}?")
        assert r["judge_verdict"] == verdict
        assert r["judge_score"] == (None if len(verdict) % 2 else float(len(verdict)))
