"""Multi-turn generation with an environment: the trajectory columns, the seed contract, failures
of the environment, a kill between turns, and the loss mask through score, advantage and train."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rlhf_batch.data.demo import write_prompts
from rlhf_batch.envs.base import Step
from rlhf_batch.envs.demo import AskLetter
from rlhf_batch.errors import ConfigError, UserError
from rlhf_batch.models.load import load_tokenizer
from rlhf_batch.observe.query import connect
from rlhf_batch.observe.report import collect
from rlhf_batch.runtime import dist, faults
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.schemas import ADVANTAGES, EVAL, ROLLOUTS, SCORES
from tests.stages.cli_helpers import cli


def ask(prompts: Path, more: str = "", env: str = "rlhf_batch.envs.demo:ask_letter") -> str:
    """The multi-turn demo task's config (6 hidden prompts x 2 in parts of 3 prompts)."""
    return f"""
[generate]
prompts = "{prompts}"
environment = "{env}"
max_turns = 2
num_generations = 2
prompts_per_part = 3
{more}
[score]
reward_functions = ["rlhf_batch.rewards.demo:ask_letter"]
"""


def rollouts(cfg) -> pa.Table:
    return manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS)


@pytest.fixture
def hidden(tmp_path: Path) -> Path:
    return write_prompts(tmp_path / "hidden.jsonl", 6, seed=0, hidden=True)


class AskAsTool(AskLetter):
    """The demo task with its letter revealed as a tool message instead of a user message."""

    def step(self, assistant_text: str) -> Step:
        return dataclasses.replace(super().step(assistant_text), role="tool")


def ask_as_tool(row: dict) -> AskAsTool:
    return AskAsTool(row)


@pytest.mark.slow
def test_trajectories_interleave_sampled_and_environment_tokens(make_config, hidden, tiny_model) -> None:
    _, cfg = make_config(ask(hidden, env="tests.stages.test_multiturn:ask_as_tool"))
    m = run_stage("generate", cfg, 0, quiet=True)
    t = rollouts(cfg)
    tok = load_tokenizer(str(tiny_model))
    assert m["rows"] == 12 and m["counts"]["turns"] == 24 and m["counts"]["env_errors"] == 0
    for r in t.to_pylist():
        ids, mask, starts = r["response_ids"], r["loss_mask"], r["turn_starts"]
        assert len(mask) == len(ids) == len(r["behavior_logprobs"])
        assert r["turn_roles"] == ["assistant", "tool", "assistant"] and starts[0] == 0
        # the tool segment: the chat template's message with the hidden letter, never trained
        tool = ids[starts[1] : starts[2]]
        assert set(mask[starts[1] : starts[2]]) == {0} and set(mask[: starts[1]] + mask[starts[2] :]) == {1}
        assert all(lp == 0.0 for lp in r["behavior_logprobs"][starts[1] : starts[2]])
        # a tool message as Qwen2.5's template renders it: a user turn holding a <tool_response>
        want = f"<|im_start|>user\n<tool_response>\n{r['letter']}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        assert want in tok.decode(tool)
        assert r["prompt"] == f"?*{r['count']}="  # the letter is not in the prompt
        assert 0.0 <= r["env_asked"] <= 1.0 and 0.0 <= r["env_answer"] <= 1.0
    # the seed contract: turn 1 is what single-turn generate samples for the same rollout id
    _, single = make_config(run_dir=str(Path(cfg.run_dir).parent / "single"), name="single.toml")
    single.generate.prompts, single.generate.num_generations, single.generate.prompts_per_part = (
        str(hidden),
        2,
        3,
    )
    run_stage("generate", single, 0, quiet=True)
    one = {r["rollout_id"]: r["response_ids"] for r in rollouts(single).to_pylist()}
    for r in t.to_pylist():
        assert r["response_ids"][: r["turn_starts"][1]] == one[r["rollout_id"]]
    assert not (layout.folder(cfg.run_dir, 0, "rollouts") / "turns").exists()  # removed once complete


class Flaky:
    """Fails as its prompt's letter says: a raises, b hangs, c returns garbage; d and e answer."""

    def __init__(self, row: dict) -> None:
        self.letter = row["letter"]

    def step(self, text: str) -> Step:
        if self.letter == "a":
            raise ValueError("no such tool")
        if self.letter == "b":
            time.sleep(60)
        if self.letter == "c":
            return "text"  # type: ignore[return-value]
        return Step("ok", role="user")


def flaky(row: dict) -> Flaky:
    return Flaky(row)


@pytest.mark.slow
def test_a_failing_environment_ends_its_trajectory_not_the_stage(make_config) -> None:
    env = 'environment = "tests.stages.test_multiturn:flaky"\nmax_turns = 3\nenv_timeout_s = 1.5\n'
    env += "max_env_error_share = 1.0\n"  # 3 of the 5 letters fail: the stage goes on
    _, cfg = make_config("[generate]\n" + env + "num_generations = 1\nprompts_per_part = 12\n")
    m = run_stage("generate", cfg, 0, quiet=True)
    rows = rollouts(cfg).to_pylist()
    want = {
        "a": "raised ValueError: no such tool",
        "b": "timed out after 1.5 s",
        "c": "the environment returned str, not a Step",
    }
    for r in rows:
        assert r["env_error"] == want.get(r["letter"])
        assert r["turns"] == (1 if r["letter"] in want else 3)
        roles = ["assistant"] if r["letter"] in want else ["assistant", "user"] * 2 + ["assistant"]
        assert r["turn_roles"] == roles
    assert m["counts"]["env_errors"] == sum(r["letter"] in want for r in rows) > 0
    # the turns view: a row per segment, the error on the trajectory's last one
    con = connect(cfg.run_dir)
    got = con.execute(
        "SELECT role, count(*), count(env_error) FROM turns GROUP BY role ORDER BY role"
    ).fetchall()
    ok = sum(r["letter"] not in want for r in rows)
    assert got == [
        ("assistant", 3 * ok + m["counts"]["env_errors"], m["counts"]["env_errors"]),
        ("user", 2 * ok, 0),
    ]
    # the report: turns per trajectory, failures and environment time by iteration
    (row,) = collect(Path(cfg.run_dir))["iters"]
    assert row["turns"] == m["counts"]["turns"] / len(rows) and row["env_errors"] == m["counts"]["env_errors"]
    assert row["env_s"] >= 1.5  # the hung call's time limit at least


def test_token_budget_cuts_the_trajectory(make_config, hidden) -> None:
    _, cfg = make_config(ask(hidden, "max_trajectory_tokens = 9\nmax_new_tokens = 6"))
    run_stage("generate", cfg, 0, quiet=True)
    for r in rollouts(cfg).to_pylist():
        # turn 1 (<= 6 tokens) fits; the user message (>= 13 tokens of template) does not
        assert len(r["response_ids"]) <= 6 and r["turns"] == 1 and r["finish_reason"] == "length"
        assert r["turn_roles"] == ["assistant"] and r["env_error"] is None


@pytest.mark.slow
def test_kill_between_turns_and_a_fan_out_give_the_uninterrupted_rows(make_config, hidden, tmp_path) -> None:
    path, cfg = make_config(ask(hidden))
    cmd = [sys.executable, "-m", "rlhf_batch", "generate", str(path), "--quiet"]
    env = {**os.environ, faults.FAULT_ENV: "rollouts:part-1:turn-1"}  # part 0 written, part 1 at turn 2
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr
    sdir = layout.folder(cfg.run_dir, 0, "rollouts")
    assert (sdir / "turns" / "part-00001.json").exists()  # turn 1 of part 1 committed
    assert len(layout.list_parts(sdir)) == 1
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    _, clean = make_config(ask(hidden), run_dir=str(tmp_path / "clean"), name="clean.toml")
    run_stage("generate", clean, 0, quiet=True)
    a, b = rollouts(cfg).drop(["env_seconds", "policy"]), rollouts(clean).drop(["env_seconds", "policy"])
    assert a.equals(b)
    # --rank r --world-size 2 (independent processes, one after the other here): rank 0 writes
    # part 0, rank 1 part 1 and commits. Rank 0 finishes first and must leave the turn
    # checkpoint of a part rank 1 is still sampling (`other`, another plan: rank 1 starts it over)
    _, fan = make_config(ask(hidden), run_dir=str(tmp_path / "fan"), name="fan.toml")
    other = layout.folder(fan.run_dir, 0, "rollouts") / "turns" / "part-00001.json"
    other.parent.mkdir(parents=True)
    other.write_text('{"rollout_ids": [], "turn": 1, "trajectories": []}')
    try:
        dist.set_fanout(0, 2)
        assert run_stage("generate", fan, 0, quiet=True) == {}  # not committed: part 1 is missing
        assert other.exists()
        dist.set_fanout(1, 2)
        assert run_stage("generate", fan, 0, quiet=True)["rows"] == 12
    finally:
        dist.set_fanout(None, None)
    assert rollouts(fan).drop(["env_seconds", "policy"]).equals(b)  # row for row
    assert not other.exists()  # removed once part 1 was written


class Killed(Exception):
    pass


@pytest.mark.slow
def test_a_turn_checkpoint_of_another_config_is_discarded(make_config, hidden, tmp_path, monkeypatch) -> None:
    """A run stopped after part 0's first turn, re-run with another temperature: its rows are a
    clean run's at the new temperature, not turn 0 of the old one and turn 1 of the new one."""
    from rlhf_batch.stages import multiturn

    def stop(name: str) -> None:
        if name == "rollouts:part-0:turn-1":
            raise Killed(name)

    _, old = make_config(ask(hidden, "max_new_tokens = 6"))
    with monkeypatch.context() as m:
        m.setattr(multiturn, "fault_point", stop)
        with pytest.raises(Killed):
            run_stage("generate", old, 0, quiet=True)
    sdir = layout.folder(old.run_dir, 0, "rollouts")
    assert not layout.list_parts(sdir)
    saved = json.loads((sdir / "turns" / "part-00000.json").read_text())
    assert saved["turn"] == 1 and saved["key"] == multiturn.stage_key(sdir)  # a same-config run resumes it
    _, new = make_config(ask(hidden, "max_new_tokens = 6\ntemperature = 0.5"))
    run_stage("generate", new, 0, quiet=True)
    _, clean = make_config(
        ask(hidden, "max_new_tokens = 6\ntemperature = 0.5"), run_dir=str(tmp_path / "clean")
    )
    run_stage("generate", clean, 0, quiet=True)
    drop = ["env_seconds", "policy"]
    assert rollouts(new).drop(drop).equals(rollouts(clean).drop(drop))


def test_bad_environment_keys_are_one_line_errors(make_config) -> None:
    with pytest.raises(ConfigError, match="'generate.environment' must be 'module:factory', got 'nocolon'"):
        make_config('[generate]\nenvironment = "nocolon"\n')
    _, cfg = make_config('[generate]\nenvironment = "tests.stages.nope:factory"\n')
    with pytest.raises(UserError, match=r"^generate.environment: cannot load 'tests.stages.nope:factory'"):
        run_stage("generate", cfg, 0, quiet=True)
    assert not layout.folder(cfg.run_dir, 0, "rollouts").exists() or not layout.list_parts(
        layout.folder(cfg.run_dir, 0, "rollouts")
    )


def test_validate_takes_the_environments_reward_parts_as_columns(make_config, hidden) -> None:
    """env_answer and env_asked are columns only generate makes: validate accepts a reward that
    reads them with an environment, and names them without one."""
    path, _ = make_config(ask(hidden))
    res = cli("validate", path)
    assert res.exit_code == 0, res.output
    rewards = '[score]\nreward_functions = ["rlhf_batch.rewards.demo:ask_letter"]\n'
    path, _ = make_config(f'[generate]\nprompts = "{hidden}"\n' + rewards, name="plain.toml")
    res = cli("validate", path)
    assert res.exit_code == 1 and "needs argument 'env_answer', 'env_asked'" in res.output


class Once:
    """Ends the trajectory at once (done), or after answering "x" once (`answer`)."""

    def __init__(self, answer: bool) -> None:
        self.answer, self.n = answer, 0

    def step(self, text: str) -> Step:
        self.n += 1
        return Step("x") if self.answer and self.n == 1 else Step(done=True)


def done_at_once(row: dict) -> Once:
    return Once(False)


def answer_once(row: dict) -> Once:
    return Once(True)


KL = "\n[score]\nkl_in_reward = true\n[train]\nkl_loss_coef = 0.01\n"
TIMING = ["tokens_per_s"]


def _pipeline(cfg) -> dict[str, pa.Table]:
    for stage in ("generate", "score", "advantage", "train"):
        run_stage(stage, cfg, 0, quiet=True)
    sdir = lambda f: layout.folder(cfg.run_dir, 0, f)  # noqa: E731
    return {
        "rollouts": rollouts(cfg),
        "scores": manifests.read_complete(sdir("scores"), SCORES),
        "advantages": manifests.read_complete(sdir("advantages"), ADVANTAGES),
        "metrics": manifests.read_table(sdir("train") / "metrics.parquet").drop(TIMING),
        "rollout_stats": manifests.read_table(sdir("train") / "rollout_stats.parquet"),
    }


@pytest.fixture
def ref_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlhf_batch.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("ref") / "ref", arch="qwen2", seed=1)


@pytest.mark.slow
def test_a_mask_of_ones_gives_the_single_turn_numbers(make_config, ref_model, tmp_path: Path) -> None:
    _, single = make_config(KL, ref_model=str(ref_model))
    env = '[generate]\nenvironment = "tests.stages.test_multiturn:done_at_once"\n'
    _, multi = make_config(env + KL, ref_model=str(ref_model), run_dir=str(tmp_path / "multi"), name="m.toml")
    a, b = _pipeline(single), _pipeline(multi)
    assert set(pc.list_flatten(b["rollouts"]["loss_mask"]).to_pylist()) == {1}
    assert a["scores"]["kl_sum"].to_pylist() != [0.0] * a["scores"].num_rows  # the reference differs
    mt = [c for c in b["rollouts"].column_names if c not in a["rollouts"].column_names]
    assert b["rollouts"].drop(mt).equals(a["rollouts"])
    assert b["scores"].equals(a["scores"])
    assert b["advantages"].drop(["loss_mask"]).equals(a["advantages"])
    assert b["metrics"].equals(a["metrics"])


@pytest.mark.slow
def test_environment_tokens_count_in_no_kl_and_no_normaliser(make_config, ref_model) -> None:
    env = '[generate]\nenvironment = "tests.stages.test_multiturn:answer_once"\nmax_turns = 2\n'
    _, cfg = make_config(env + KL, ref_model=str(ref_model))
    out = _pipeline(cfg)
    r, s = out["rollouts"].to_pylist(), out["scores"].to_pylist()
    for roll, sc in zip(r, s, strict=True):
        mask = roll["loss_mask"]
        assert 0 in mask  # every trajectory holds the tool message
        # k1 per sampled token: behaviour - reference (the policy here is the sampler)
        want = sum(
            b - f for b, f, m in zip(roll["behavior_logprobs"], sc["ref_logprobs"], mask, strict=True) if m
        )
        assert sc["kl_sum"] == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert all(k == 0.0 for k, m in zip(sc["kl"], mask, strict=True) if not m)
    adv = out["advantages"]
    sampled = sum(sum(m) for m in adv["loss_mask"].to_pylist())
    assert sampled < sum(len(m) for m in adv["loss_mask"].to_pylist())
    assert sum(out["metrics"]["tokens"].to_pylist()) == sampled  # one epoch: each row once
    trained = dict(
        zip(adv["rollout_id"].to_pylist(), [sum(m) for m in adv["loss_mask"].to_pylist()], strict=True)
    )
    for row in out["rollout_stats"].to_pylist():
        assert row["tokens"] == trained[row["rollout_id"]]


def test_single_turn_identity_is_unchanged(make_config) -> None:
    _, single = make_config()
    _, multi = make_config('[generate]\nenvironment = "rlhf_batch.envs.demo:ask_letter"\nenv_workers = 3\n')
    keys = ("environment", "max_turns", "max_trajectory_tokens", "env_timeout_s", "env_workers")
    assert not set(keys) & set(single.identity("generate")["generate"])  # as before these keys
    got = multi.identity("generate")["generate"]
    assert got["environment"] == "rlhf_batch.envs.demo:ask_letter" and got["max_turns"] == 4
    assert "env_workers" not in got  # how many processes step the environments decides nothing


class Chars:
    """Answers the first assistant turn with "ok" (a user message) and ends at the second; its
    reward part `chars` is each assistant text's length."""

    def __init__(self, row: dict) -> None:
        self.n = 0

    def step(self, text: str) -> Step:
        self.n += 1
        return Step("ok" if self.n == 1 else None, role="user", reward_parts={"chars": float(len(text))})


def chars(row: dict) -> Chars:
    return Chars(row)


def env_chars(*, env_chars: list[float], **_: object) -> list[float]:
    """An eval reward function that reads the environment's reward part."""
    return list(env_chars)


def test_eval_runs_the_turn_loop_and_its_rewards_read_the_environments_parts(make_config, tmp_path) -> None:
    held_out = write_prompts(tmp_path / "held_out.jsonl", 3, seed=1, hidden=True)
    env = '[generate]\nenvironment = "tests.stages.test_multiturn:chars"\nmax_turns = 2\nenv_workers = 1\n'
    ev = f'[eval]\nprompts = "{held_out}"\nn = 2\nreward_functions = ["tests.stages.test_multiturn:env_chars"]\n'
    _, cfg = make_config(env + ev)
    m = run_stage("eval", cfg, 0, quiet=True)
    sdir = layout.folder(cfg.run_dir, 0, "eval")
    t = manifests.read_complete(sdir, EVAL).to_pylist()
    tok = load_tokenizer(cfg.policy_model)
    assert len(t) == 3 * 2 and m["overall"]["prompts"] == 3
    for r in t:
        ids, starts, mask = r["response_ids"], r["turn_starts"], r["loss_mask"]
        assert len(mask) == len(ids) == len(r["behavior_logprobs"]) and r["env_error"] is None
        if r["turns"] == 2:  # else the token budget (the model's positions) ended it after turn 1
            assert r["turn_roles"] == ["assistant", "user", "assistant"]
            assert "ok" in tok.decode(ids[starts[1] : starts[2]]) and set(mask[starts[1] : starts[2]]) == {0}
        # the environment saw each assistant turn's text: its tokens without the stop token (the
        # tiny model's EOS 0 or <|im_end|> 4) that ended it
        bounds = [*starts, len(ids)]
        segs = [
            ids[a:b]
            for a, b, role in zip(starts, bounds[1:], r["turn_roles"], strict=True)
            if role == "assistant"
        ]
        texts = [tok.decode(s[:-1] if s and s[-1] in (0, 4) else s) for s in segs]
        assert r["env_chars"] == r["reward_env_chars"] == r["reward"] == float(sum(map(len, texts)))
    assert any(r["turns"] == 2 for r in t)
    assert not (sdir / "turns").exists()  # removed once complete
