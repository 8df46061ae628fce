"""Multi-turn generation with tools, turn by turn with a policy that writes given turns (a
scripted sampler: the turns' token ids, in order, whatever the context): the tools reach the
chat template, several calls get one tool message each, generated and imported trajectories of
one conversation are the same tokens, the per-turn seeds and the token budget's edge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlhf_batch.commands.pipeline import trajectory_line
from rlhf_batch.data import chat_turns
from rlhf_batch.data.prompts import load_prompts
from rlhf_batch.envs.base import Step
from rlhf_batch.envs.pool import EnvPool
from rlhf_batch.envs.tools import template_tools
from rlhf_batch.errors import StageError
from rlhf_batch.models.load import load_tokenizer
from rlhf_batch.observe.status import print_status
from rlhf_batch.rewards import load_reward_functions
from rlhf_batch.rewards.cache import RewardCalls
from rlhf_batch.stages.generate import DROPPED, Generate, generate_part
from rlhf_batch.stages.registry import run_stage
from rlhf_batch.store import layout, manifests
from rlhf_batch.store.ids import row_seed
from rlhf_batch.store.schemas import ROLLOUTS
from tests.stages.cli_helpers import cli


class Scripted:
    """Samples the given turns (texts, each ended by <|im_end|>) one after the other, and records
    the seeds and contexts each turn was asked with."""

    def __init__(self, tok: Any, turns: list[str]) -> None:
        stop = tok.convert_tokens_to_ids("<|im_end|>")
        self.turns = [[*tok(t, add_special_tokens=False)["input_ids"], stop] for t in turns]
        self.seeds: list[list[int]] = []
        self.contexts: list[list[list[int]]] = []

    def sample(self, contexts: list[list[int]], seeds: list[int], bar: Any) -> list[tuple]:
        turn = len(self.seeds)
        self.seeds.append(list(seeds))
        self.contexts.append([list(c) for c in contexts])
        ids = self.turns[turn]
        return [(list(ids), [-0.5] * len(ids), "stop") for _ in contexts]


class _Bar:
    def update(self, n: int) -> None: ...


CALLS = [{"expression": "6*7"}, {"expression": "1+2"}]
PROMPT = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "6*7 and 1+2?"}]
ASSISTANT_CALLS = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": a}} for a in CALLS],
}
CONVERSATION = [
    *PROMPT,
    ASSISTANT_CALLS,
    {"role": "tool", "content": "42"},
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "42 and 3"},
]


def _assistant_texts(tok: Any) -> list[str]:
    """The assistant turns as the chat template renders them (what import tokenises)."""
    rendered = tok.apply_chat_template(CONVERSATION, tools=template_tools(["calculator"]), tokenize=False)
    texts = rendered.split("<|im_start|>assistant\n")[1:]
    return [t.split("<|im_end|>")[0] for t in texts]


def _generate(make_config, tmp_path: Path, env: str, turns: list[str], more: str = "") -> tuple[Any, ...]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts_file = tmp_path / "tools.jsonl"
    prompts_file.write_text(json.dumps({"id": 7, "messages": PROMPT, "tools": ["calculator"]}) + "\n")
    _, cfg = make_config(
        f'[generate]\nprompts = "{prompts_file}"\nenvironment = "{env}"\nnum_generations = 1\n{more}'
    )
    tok = load_tokenizer(cfg.policy_model)
    prompts = load_prompts(cfg.generate, tok)
    engine = Scripted(tok, turns)
    pool = EnvPool(cfg.generate.environment, 1, 30.0, tool_parser=cfg.generate.tool_parser)
    try:
        table = generate_part(
            engine, tok, prompts, 0, cfg, 0, cfg.policy_model, _Bar(), pool=pool, where=tmp_path
        )
    finally:
        pool.close()
    return cfg, tok, engine, table


def test_generated_and_imported_trajectories_are_the_same_tokens(make_config, tmp_path: Path) -> None:
    tok = load_tokenizer(str(make_config()[1].policy_model))
    env = "rlhf_batch.envs.tools:tool_environment"
    cfg, tok, engine, table = _generate(make_config, tmp_path, env, _assistant_texts(tok))
    (row,) = table.to_pylist()
    # the tools reached the chat template: the prompt holds the calculator's schema
    assert '"name": "calculator"' in row["prompt"] and "# Tools" in row["prompt"]
    # import's tokenisation of the same conversation (data/chat_turns.py, as `import` runs it)
    msgs = chat_turns.normalize(CONVERSATION, "conversation")
    imported = chat_turns.tokenize(tok, msgs, template_tools(["calculator"]), "conversation")
    assert row["prompt_ids"] == imported.prompt_ids
    assert row["response_ids"] == imported.response_ids
    assert row["loss_mask"] == imported.loss_mask
    assert row["turn_starts"] == imported.turn_starts
    # two calls: two tool messages, as Qwen's format and import take them
    assert row["turn_roles"] == imported.turn_roles == ["assistant", "tool", "tool", "assistant"]
    assert row["env_tool_calls"] == 2.0 and row["env_error"] is None and row["finish_reason"] == "stop"
    # the second turn was sampled with the tool results in its context
    assert engine.contexts[1][0] == row["prompt_ids"] + row["response_ids"][: row["turn_starts"][3]]


class Echo:
    """Answers each turn with a user message "ok" (2 turns at most by max_turns)."""

    def __init__(self, row: dict) -> None:
        self.row = row

    def step(self, text: str) -> Step:
        return Step("ok", role="user")


def echo(row: dict) -> Echo:
    return Echo(row)


class SeesRow:
    """Fails with its row's keys (so the test reads what the factory got) unless `id` is there."""

    def __init__(self, row: dict) -> None:
        if row.get("id") != "7" or row.get("messages") != PROMPT:
            raise ValueError(f"row keys {sorted(row)}")

    def step(self, text: str) -> Step:
        return Step(done=True)


def sees_row(row: dict) -> SeesRow:
    return SeesRow(row)


def test_each_turn_has_its_own_seed_and_the_row_keeps_its_column_names(make_config, tmp_path: Path) -> None:
    cfg, tok, engine, table = _generate(
        make_config, tmp_path, "tests.stages.test_multiturn_tools:echo", ["a", "b", "c"], "max_turns = 3\n"
    )
    (row,) = table.to_pylist()
    rollout_seed = row_seed(cfg.seed, row["rollout_id"])
    # documented (docs/multi-turn.md): turn 0 the rollout's seed, turn t row_seed(seed, "turn-t")
    assert engine.seeds == [
        [rollout_seed],
        [row_seed(rollout_seed, "turn-1")],
        [row_seed(rollout_seed, "turn-2")],
    ]
    assert len({s[0] for s in engine.seeds}) == 3
    # the factory's row: the prompt file's `id` and `messages` columns under their own names
    _, _, _, table = _generate(
        make_config, tmp_path / "row", "tests.stages.test_multiturn_tools:sees_row", ["a"]
    )
    assert table["env_error"].to_pylist() == [None]


@pytest.mark.parametrize("budget", [0, 1])
def test_a_trajectory_exactly_at_the_token_budget_drops_the_observation(
    make_config, tmp_path, budget
) -> None:
    tok = load_tokenizer(make_config()[1].policy_model)
    # "a" + <|im_end|> (2 tokens), then the user message "ok" and the next turn's header
    obs = len(
        tok("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
            "input_ids"
        ]
    )
    limit = 2 + obs + budget  # budget 0: the observation fills it exactly, no token left for a turn
    cfg, tok, engine, table = _generate(
        make_config,
        tmp_path,
        "tests.stages.test_multiturn_tools:echo",
        ["a", "b"],
        f"max_turns = 2\nmax_trajectory_tokens = {limit}\n",
    )
    (row,) = table.to_pylist()
    if budget == 0:
        assert row["turn_roles"] == ["assistant"] and len(row["response_ids"]) == 2
        assert row["finish_reason"] == "length" and table.schema.metadata[DROPPED.encode()] == b"1"
    else:  # one token of room: the second turn is sampled and cut to it
        assert row["turn_roles"] == ["assistant", "user", "assistant"] and len(row["response_ids"]) == limit
        assert table.schema.metadata[DROPPED.encode()] == b"0"


class Broken:
    def __init__(self, row: dict) -> None:
        raise KeyError("answer")


def broken(row: dict) -> Broken:
    return Broken(row)


def test_an_environment_failing_on_most_trajectories_stops_the_stage(make_config, tmp_path: Path) -> None:
    with pytest.raises(
        StageError,
        match=r"failed in 1 of 1 trajectories of part 0 .*first, rollout .*: raised KeyError: 'answer'",
    ):
        _generate(make_config, tmp_path, "tests.stages.test_multiturn_tools:broken", ["a"])
    assert not list((tmp_path / "turns").glob("part-*"))  # a rerun samples the part again
    _, _, _, table = _generate(
        make_config,
        tmp_path / "b",
        "tests.stages.test_multiturn_tools:broken",
        ["a"],
        "max_env_error_share = 1.0\n",
    )
    assert table["env_error"].to_pylist() == ["raised KeyError: 'answer'"]


def says_42(*, completion_messages: list, responses: list, **_: Any) -> list[float]:
    """1.0 when the last assistant message says 42 (a tool's output does not count)."""
    last = [[m for m in msgs if m["role"] == "assistant"][-1]["content"] for msgs in completion_messages]
    return [float("42" in text) for text in last]


def trl_says_42(prompts: list, completions: list, **_: Any) -> list[float]:
    """The same with TRL's conversational completions (a list of messages per rollout)."""
    return [float("42" in [m for m in c if m["role"] == "assistant"][-1]["content"]) for c in completions]


def test_rewards_read_messages_and_a_tool_output_is_not_the_answer(make_config, tmp_path: Path) -> None:
    tok = load_tokenizer(str(make_config()[1].policy_model))
    texts = _assistant_texts(tok)
    texts[1] = "I could not tell"  # the calculator said 42; the answer does not
    cfg, tok, _, table = _generate(make_config, tmp_path, "rlhf_batch.envs.tools:tool_environment", texts)
    assert "42" in tok.decode(table["response_ids"][0].as_py())  # the flat response holds the tool's 42
    calls = RewardCalls.from_config(cfg)
    batch = calls.batch(table, table["prompt_ids"].to_pylist(), table["response_ids"].to_pylist())
    assert batch["completion_messages"] == [
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": a}} for a in CALLS
                ],
            },
            {"role": "tool", "content": "42", "name": "calculator"},
            {"role": "tool", "content": "3", "name": "calculator"},
            {"role": "assistant", "content": "I could not tell"},
        ]
    ]
    fns = load_reward_functions(
        ["tests.stages.test_multiturn_tools:says_42", "trl:tests.stages.test_multiturn_tools:trl_says_42"]
    )
    values, _ = calls.values(fns, table["rollout_id"].to_pylist(), batch)
    assert values == {"reward_says_42": [0.0], "reward_trl_says_42": [0.0]}
    # the same rollout with the answer in its last turn scores 1.0
    texts[1] = "6*7 is 42"
    _, _, _, table = _generate(make_config, tmp_path / "b", "rlhf_batch.envs.tools:tool_environment", texts)
    batch = calls.batch(table, table["prompt_ids"].to_pylist(), table["response_ids"].to_pylist())
    values, _ = calls.values(fns, table["rollout_id"].to_pylist(), batch)
    assert values == {"reward_says_42": [1.0], "reward_trl_says_42": [1.0]}


def typo_reward(*, env_answr: list, **_: Any) -> list[float]:
    return list(env_answr)


def test_validate_checks_env_arguments_against_the_declared_reward_parts(make_config, tmp_path: Path) -> None:
    env = '[generate]\nenvironment = "rlhf_batch.envs.demo:ask_letter"\n'
    ok, _ = make_config(env + '[score]\nreward_functions = ["rlhf_batch.rewards.demo:ask_letter"]\n')
    res = cli("validate", ok)
    assert (
        res.exit_code == 0
        and "generate.environment rlhf_batch.envs.demo:ask_letter (reward parts asked, answer)" in res.output
    )
    typo, _ = make_config(
        env + '[score]\nreward_functions = ["tests.stages.test_multiturn_tools:typo_reward"]\n',
        name="typo.toml",
    )
    res = cli("validate", typo)
    assert res.exit_code == 1 and "needs argument 'env_answr', which no column" in res.output
    assert "env_answer" in res.output  # the columns there are: the declared parts
    bad, _ = make_config('[generate]\nenvironment = "tests.stages.nope:factory"\n', name="bad.toml")
    res = cli("validate", bad)
    assert (
        res.exit_code == 1 and "generate.environment: cannot load 'tests.stages.nope:factory'" in res.output
    )


class HalfBroken:
    """Fails on the prompts whose letter is a or b; ends the others at once."""

    def __init__(self, row: dict) -> None:
        if row["letter"] in "ab":
            raise ValueError("no tool")

    def step(self, text: str) -> Step:
        return Step(done=True)


def half_broken(row: dict) -> HalfBroken:
    return HalfBroken(row)


def test_status_and_run_show_the_env_error_and_truncated_shares(make_config, capsys) -> None:
    env = 'environment = "tests.stages.test_multiturn_tools:half_broken"\nmax_env_error_share = 1.0\n'
    _, cfg = make_config("[generate]\n" + env + "num_generations = 1\nprompts_per_part = 20\n")
    m = run_stage("generate", cfg, 0, quiet=True)
    t = Generate(cfg, 0)
    rows = manifests.read_complete(layout.folder(cfg.run_dir, 0, "rollouts"), ROLLOUTS).to_pylist()
    failed = sum(r["env_error"] is not None for r in rows)
    cut = sum(r["finish_reason"] == "length" for r in rows)
    assert failed == sum(r["letter"] in "ab" for r in rows) > 0 and m["counts"]["truncated"] == cut
    line = trajectory_line(t)
    assert line == f"truncated {cut / len(rows):.3g}, env_error {failed / len(rows):.4g}"
    print_status(cfg.run_dir)
    out = capsys.readouterr().out
    (status,) = [x for x in out.splitlines() if " rollouts " in x]
    assert f"env_error {failed / len(rows):.4g}" in status and "truncated" in status
