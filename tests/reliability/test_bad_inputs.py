"""A catalogue of bad inputs: each must end the command with exit 1 and ONE line `error: ...`
naming the file, row/column/rollout or option, no traceback, and no existing output changed.

Stage inputs are copied from the reference run (real Parquet written by the real stages), then
broken the way a user or a disk would break them. Commands run through `rlhf_batch.commands.cli.run_cli`
in this process (the same code path as the console script, without 3 s of imports per case);
`test_real_cli_process` checks the same contract on a real process, and `--debug`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import tomli_w

from rlhf_batch.store import layout, manifests, output
from rlhf_batch.store.schemas import ADVANTAGES, ROLLOUTS, SCORES
from tests.reliability.harness import DEMO, TRAIN, Assets, snapshot

DEMO_REWARD = "rlhf_batch.rewards.demo:letter_count"


def demo_table(name: str) -> dict:
    """A table of pipelines/demo.toml, which the reference run of the harness uses."""
    import tomllib

    return dict(tomllib.loads(DEMO.read_text())[name])


@dataclass
class Ctx:
    """One case's directory: a config, stage inputs copied from the reference run, broken files."""

    tmp: Path
    assets: Assets
    reference: Path
    monkeypatch: pytest.MonkeyPatch | None = None

    @property
    def run(self) -> Path:
        return self.tmp / "run"

    def config(self, **tables: object) -> str:
        """The shortened demo config (the reference run's stage identities), `tables` merged in."""
        raw: dict = {
            "run_dir": str(self.run),
            "seed": 0,
            "policy_model": str(self.assets.policy),
            "device": "cpu",
            "dtype": "float32",
            "threads": 1,
            "generate": {
                "prompts": str(self.assets.prompts),
                "num_generations": 8,
                "max_new_tokens": 8,
                "batch_size": 256,
                "prompts_per_part": 16,
            },
            "score": {"reward_functions": [DEMO_REWARD], "kl_in_reward": False, "rows_per_part": 128},
            "advantage": {"rows_per_part": 32},
            "train": {**demo_table("train"), **TRAIN},  # as the harness's command (harness.overrides)
        }
        for key, value in tables.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key].update(value)
            else:
                raw[key] = value
        raw = {k: _drop_none(v) for k, v in raw.items() if v is not None}  # None: the key left out
        path = self.tmp / "config.toml"
        path.write_text(tomli_w.dumps(raw))
        return str(path)

    def copy(self, *stages: str, it: int = 0) -> None:
        for stage in stages:
            shutil.copytree(layout.folder(self.reference, it, stage), layout.folder(self.run, it, stage))

    def part(self, stage: str, n: int = 0) -> Path:
        return layout.folder(self.run, 0, stage) / layout.part_name(0, n)

    def edit(self, stage: str, fn: Callable[[pa.Table], pa.Table], n: int = 0) -> None:
        """Rewrite part n of a copied stage with fn(table), as a user editing the file would."""
        pq.write_table(fn(pq.read_table(self.part(stage, n))), self.part(stage, n))

    def rid(self, stage: str, row: int, n: int = 0) -> str:
        return pq.read_table(self.part(stage, n), columns=["rollout_id"])["rollout_id"][row].as_py()

    def write(self, name: str, text: str) -> str:
        (self.tmp / name).write_text(text)
        return str(self.tmp / name)

    def module(self, name: str, source: str) -> str:
        """A reward-function module importable by name (the case's directory is on sys.path)."""
        (self.tmp / f"{name}.py").write_text(source)
        return name


def _drop_none(value: object) -> object:
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def set_row(table: pa.Table, column: str, row: int, value: object) -> pa.Table:
    values = table[column].to_pylist()
    values[row] = value
    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def cast(table: pa.Table, column: str, typ: pa.DataType) -> pa.Table:
    i = table.schema.get_field_index(column)
    return table.set_column(i, pa.field(column, typ), table[column].cast(typ))


def prompts(ctx: Ctx, lines: list[object]) -> str:
    return ctx.write("prompts.jsonl", "".join(json.dumps(x) + "\n" for x in lines))


def model_copy(ctx: Ctx, name: str, edit: Callable[[Path], None]) -> str:
    out = ctx.tmp / name
    shutil.copytree(ctx.assets.policy, out)
    edit(out)
    return str(out)


def two_label_reward_model(ctx: Ctx) -> str:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    cfg = AutoConfig.from_pretrained(ctx.assets.policy, num_labels=2)
    out = ctx.tmp / "rm2"
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(ctx.assets.policy).save_pretrained(out)
    return str(out)


def empty_stage(ctx: Ctx, stage: str) -> None:
    """A complete stage of 0 rows, with its manifest."""
    st = output.claim(layout.folder(ctx.run, 0, stage), stage, {"empty": True}, {})
    st.finish(0)


def _score(ctx: Ctx, **tables: object) -> list[str]:
    ctx.copy("rollouts")
    return ["score", ctx.config(**tables), "--quiet"]


def _advantage(ctx: Ctx) -> list[str]:
    ctx.copy("rollouts", "scores")
    return ["advantage", ctx.config(), "--quiet"]


def _train(ctx: Ctx) -> list[str]:
    ctx.copy("advantages")
    return ["train", ctx.config(), "--quiet"]


def _generate(ctx: Ctx, **tables: object) -> list[str]:
    return ["generate", ctx.config(**tables), "--quiet"]


Case = Callable[[Ctx], tuple[list[str], list[str]]]  # -> (command line, what the message must name)
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------- config
@case
def config_unknown_key(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(sede=1)
    return ["generate", path], [path, "unknown key 'sede'", "did you mean 'seed'"]


@case
def config_misspelt_table_key(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(generate={"temprature": 0.7})
    return ["generate", path], [
        path,
        "unknown key 'generate.temprature'",
        "did you mean 'generate.temperature'",
    ]


@case
def config_misspelt_table(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(trian={"lr": 0.1})
    return ["train", path], [path, "unknown key 'trian'", "did you mean 'train'"]


@case
def config_wrong_type(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(generate={"temperature": "hot"})
    return ["generate", path], [path, "'generate.temperature' must be float, got 'hot'"]


@case
def config_wrong_type_bool(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(score={"kl_in_reward": "yes"})
    return ["score", path], [path, "'score.kl_in_reward' must be bool"]


@case
def config_not_a_choice(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(advantage={"estimator": "ppo"})
    return ["advantage", path], [
        path,
        "'advantage.estimator' must be one of 'grpo', 'drgrpo', 'rloo', 'opd', got 'ppo'",
    ]


@case
def config_out_of_range(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(generate={"num_generations": 0})
    return ["generate", path], [path, "'generate.num_generations' must be >= 1"]


def _value_case(name: str, command: str, table: str | None, key: str, value: object, says: str) -> None:
    """A config value that is out of range for `key` (in [table], or top level)."""

    def make(ctx: Ctx):  # noqa: ANN202
        path = ctx.config(**({table: {key: value}} if table else {key: value}))
        return [command, path], [path, f"'{table + '.' if table else ''}{key}", says]

    CASES[name] = make


for _name, _cmd, _table, _key, _value, _says in (
    ("config_rows_per_part_zero", "score", "score", "rows_per_part", 0, "must be >= 1"),
    (
        "config_kl_reward_coef_inf",
        "score",
        "score",
        "kl_reward_coef",
        float("inf"),
        "must be a finite number",
    ),
    ("config_eps_high_negative", "train", "train", "eps_high", -0.1, "must be >= 0"),
    ("config_weight_decay_negative", "train", "train", "weight_decay", -0.01, "must be >= 0"),
    ("config_lr_huge", "train", "train", "lr", 1e39, "must be in [0, 1]"),
    (
        "config_temperature_inf",
        "generate",
        "generate",
        "temperature",
        float("inf"),
        "must be a finite number",
    ),
    (
        "config_reward_weight_nan",
        "score",
        "score",
        "reward_weights",
        [float("nan")],
        "must be a finite number",
    ),
    ("config_run_dir_empty", "generate", None, "run_dir", " ", "must not be empty"),
    ("config_max_grad_norm_negative", "train", "train", "max_grad_norm", -1.0, "must be >= 0"),
    ("config_warmup_steps_negative", "train", "train", "warmup_steps", -3, "must be >= 0"),
):
    _value_case(_name, _cmd, _table, _key, _value, _says)


@case
def config_binary_file(ctx: Ctx):  # noqa: ANN201
    path = ctx.tmp / "config.toml"
    path.write_bytes(bytes(range(256)))
    return ["generate", str(path)], [str(path), "not a text file"]


@case
def config_table_is_a_value(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(train=3)
    return ["train", path], [path, "'train' must be a table [train]"]


@case
def set_wrong_type(ctx: Ctx):  # noqa: ANN201
    return ["train", ctx.config(), "--set", "train.lr=fast"], ["'train.lr' must be float, got 'fast'"]


@case
def set_misspelt_key(ctx: Ctx):  # noqa: ANN201
    return ["train", ctx.config(), "--set", "train.lrr=0.1"], [
        "unknown key 'train.lrr'",
        "did you mean 'train.lr'",
    ]


@case
def set_without_value(ctx: Ctx):  # noqa: ANN201
    return ["generate", ctx.config(), "--set", "seed"], ["--set 'seed'", "expected KEY=VALUE"]


@case
def config_without_policy_model(ctx: Ctx):  # noqa: ANN201
    return _generate(ctx, policy_model=None), ["policy_model: no model directory configured"]


@case
def config_without_prompts(ctx: Ctx):  # noqa: ANN201
    return _generate(ctx, generate={"prompts": None}), ["generate.prompts: no prompt file configured"]


@case
def config_file_missing(ctx: Ctx):  # noqa: ANN201
    return ["run", str(ctx.tmp / "none.toml")], [f"{ctx.tmp / 'none.toml'}: config file not found"]


@case
def config_not_toml(ctx: Ctx):  # noqa: ANN201
    path = ctx.write("bad.toml", "seed = = 1\n")
    return ["run", path], [path, "not valid TOML"]


# ---------------------------------------------------------------- models
@case
def policy_dir_missing(ctx: Ctx):  # noqa: ANN201
    missing = str(ctx.tmp / "no-such-model")
    return _generate(ctx, policy_model=missing), ["policy", f"model directory not found: {missing}"]


@case
def policy_without_safetensors(ctx: Ctx):  # noqa: ANN201
    def to_pickle(p: Path) -> None:
        (p / "model.safetensors").rename(p / "pytorch_model.bin")

    path = model_copy(ctx, "pickled", to_pickle)
    return _generate(ctx, policy_model=path), [
        f"{path} has no *.safetensors weights (only safetensors are loaded)"
    ]


@case
def policy_without_config(ctx: Ctx):  # noqa: ANN201
    path = model_copy(ctx, "noconfig", lambda p: (p / "config.json").unlink())
    return _generate(ctx, policy_model=path), [f"{path} has no config.json"]


@case
def policy_needs_remote_code(ctx: Ctx):  # noqa: ANN201
    def remote(p: Path) -> None:
        cfg = json.loads((p / "config.json").read_text())
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
        (p / "config.json").write_text(json.dumps(cfg))
        (p / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")

    path = model_copy(ctx, "remote", remote)
    return _generate(ctx, policy_model=path), [path, "needs remote code", "trust_remote_code"]


@case
def policy_without_tokenizer_json(ctx: Ctx):  # noqa: ANN201
    path = model_copy(ctx, "notokenizer", lambda p: (p / "tokenizer.json").unlink())
    return _generate(ctx, policy_model=path), [path, "no tokens", "tokenizer.json"]


@case
def reference_with_another_vocabulary(ctx: Ctx):  # noqa: ANN201
    from rlhf_batch.models.tiny import init_model

    ref = str(init_model(ctx.tmp / "ref160", vocab_size=160, seed=0))
    return _score(ctx, ref_model=ref), [ref, "different vocabularies"]


@case
def reward_model_with_two_labels(ctx: Ctx):  # noqa: ANN201
    rm = two_label_reward_model(ctx)
    return _score(ctx, reward_model=rm), ["reward_model", rm, "has 2 labels; a reward model needs 1"]


@case
def reward_model_not_a_classifier(ctx: Ctx):  # noqa: ANN201
    return _score(ctx, reward_model=str(ctx.assets.policy)), [
        f"reward_model: {ctx.assets.policy} is not a sequence-classification model"
    ]


def _edit_weights(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(p: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(p / "model.safetensors")
        edit(tensors)
        save_file(tensors, p / "model.safetensors", metadata={"format": "pt"})

    return apply


def _first_mlp(tensors: dict) -> str:
    return next(k for k in sorted(tensors) if "mlp.down_proj" in k)


@case
def policy_weights_truncated(ctx: Ctx):  # noqa: ANN201
    def cut(p: Path) -> None:
        f = p / "model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])

    path = model_copy(ctx, "truncated", cut)
    return _generate(ctx, policy_model=path), ["policy", f"cannot load {path}", "header"]


@case
def policy_weights_empty(ctx: Ctx):  # noqa: ANN201
    path = model_copy(ctx, "emptyweights", lambda p: (p / "model.safetensors").write_bytes(b""))
    return _generate(ctx, policy_model=path), ["policy", f"cannot load {path}"]


@case
def policy_weights_random_bytes(ctx: Ctx):  # noqa: ANN201
    path = model_copy(ctx, "noise", lambda p: (p / "model.safetensors").write_bytes(bytes(range(256)) * 64))
    return _generate(ctx, policy_model=path), ["policy", f"cannot load {path}"]


@case
def policy_weight_missing(ctx: Ctx):  # noqa: ANN201
    path = model_copy(ctx, "lacking", _edit_weights(lambda t: t.pop(_first_mlp(t))))
    return _generate(ctx, policy_model=path), [path, "lacks the weight model.layers.0.mlp.down_proj.weight"]


@case
def policy_weight_of_the_wrong_shape(ctx: Ctx):  # noqa: ANN201
    import torch

    path = model_copy(ctx, "misshapen", _edit_weights(lambda t: t.update({_first_mlp(t): torch.zeros(3, 3)})))
    return _generate(ctx, policy_model=path), [path, "weights of the wrong shape"]


@case
def policy_weights_nan(ctx: Ctx):  # noqa: ANN201
    def nan(t: dict) -> None:
        t[_first_mlp(t)] = t[_first_mlp(t)] * float("nan")

    path = model_copy(ctx, "nanweights", _edit_weights(nan))
    return _generate(ctx, policy_model=path), [
        path,
        "non-finite values",
        "model.layers.0.mlp.down_proj.weight",
    ]


@case
def policy_logits_overflow(ctx: Ctx):  # noqa: ANN201
    """Finite weights whose activations overflow float16 (a final norm of 6e4): NaN logits."""

    def big(t: dict) -> None:
        t["model.norm.weight"] = t["model.norm.weight"] * 0 + 6e4

    path = model_copy(ctx, "overflow", _edit_weights(big))
    return _generate(ctx, policy_model=path, dtype="float16"), [path, "non-finite behaviour log-prob"]


@case
def reference_weights_nan(ctx: Ctx):  # noqa: ANN201
    def inf(t: dict) -> None:
        t[_first_mlp(t)] = t[_first_mlp(t)] + float("inf")

    path = model_copy(ctx, "infref", _edit_weights(inf))
    # KL in the reward: the reference is loaded (without any KL it is not)
    return _score(ctx, ref_model=path, score={"kl_in_reward": True}), ["ref_model", path, "non-finite values"]


# ---------------------------------------------------------------- prompts
@case
def prompts_missing(ctx: Ctx):  # noqa: ANN201
    missing = str(ctx.tmp / "none.jsonl")
    return _generate(ctx, generate={"prompts": missing}), [f"{missing}: prompt file not found"]


@case
def prompts_empty(ctx: Ctx):  # noqa: ANN201
    path = ctx.write("empty.jsonl", "")
    return _generate(ctx, generate={"prompts": path}), [f"{path}: the prompt file is empty"]


@case
def prompts_wrong_column(ctx: Ctx):  # noqa: ANN201
    path = prompts(ctx, [{"id": "a", "question": "x*1="}])
    return _generate(ctx, generate={"prompts": path}), [
        path,
        "no 'prompt' or 'messages' column",
        "generate.prompt_column",
    ]


@case
def prompts_null(ctx: Ctx):  # noqa: ANN201
    path = prompts(
        ctx, [{"id": "a", "prompt": "x*1="}, {"id": "b", "prompt": "y*2="}, {"id": "c", "prompt": None}]
    )
    return _generate(ctx, generate={"prompts": path}), [path, "row 2", "'prompt' is null or empty"]


@case
def prompts_not_strings(ctx: Ctx):  # noqa: ANN201
    path = prompts(ctx, [{"id": "a", "prompt": 1}, {"id": "b", "prompt": 2}])
    return _generate(ctx, generate={"prompts": path}), [
        path,
        "column 'prompt' must hold strings or chat messages (a list of {role, content}), not int64",
    ]


@case
def prompts_mixed_types(ctx: Ctx):  # noqa: ANN201
    path = prompts(ctx, [{"id": "a", "prompt": "x*1="}, {"id": "b", "prompt": 7}])
    return _generate(ctx, generate={"prompts": path}), [path, "cannot read prompts", "prompt", "row 1"]


@case
def prompts_overlong(ctx: Ctx):  # noqa: ANN201
    return _generate(ctx, generate={"max_prompt_tokens": 3}), [
        str(ctx.assets.prompts),
        "row 0 (prompt_id demo-000000) has 4 tokens > generate.max_prompt_tokens = 3",
    ]


@case
def prompts_duplicate_ids(ctx: Ctx):  # noqa: ANN201
    path = prompts(
        ctx, [{"id": "a", "prompt": "x*1="}, {"id": "b", "prompt": "y*1="}, {"id": "a", "prompt": "z*1="}]
    )
    return _generate(ctx, generate={"prompts": path}), [path, "rows 0 and 2 have the same id 'a'"]


@case
def prompts_not_json(ctx: Ctx):  # noqa: ANN201
    path = ctx.write("broken.jsonl", '{"prompt": "x*1="}\n{"prompt": \n')
    return _generate(ctx, generate={"prompts": path}), [path, "cannot read prompts"]


# ---------------------------------------------------------------- stage files
@case
def part_truncated(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    data = ctx.part("rollouts", 1).read_bytes()
    ctx.part("rollouts", 1).write_bytes(data[: len(data) // 2])
    return args, [str(ctx.part("rollouts", 1)), "not a readable Parquet file"]


@case
def part_not_parquet(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.part("rollouts", 2).write_text("rollout_id,prompt\n0000-a-0,x\n")
    return args, [str(ctx.part("rollouts", 2)), "not a readable Parquet file"]


@case
def part_column_of_another_type(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: cast(t, "response_ids", pa.list_(pa.int64())))
    return args, [
        str(ctx.part("rollouts", 0)),
        "column 'response_ids' has type list<",
        "int64>, expected list<item: int32>",
    ]


@case
def part_column_missing(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: t.drop_columns(["behavior_logprobs"]), n=1)
    return args, [str(ctx.part("rollouts", 1)), "missing column 'behavior_logprobs'"]


@case
def part_null_in_a_required_column(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: set_row(t, "response", 1, None))
    return args, [
        str(layout.folder(ctx.run, 0, "rollouts")),
        f"column 'response' is null in rollout {ctx.rid('rollouts', 1)}",
    ]


@case
def token_id_outside_the_vocabulary(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: set_row(t, "response_ids", 3, [5000] + t["response_ids"][3].as_py()[1:]))
    return args, [
        f"rollout {ctx.rid('rollouts', 3)} has token id 5000 in response_ids",
        "outside the model vocabulary",
    ]


@case
def logprobs_shorter_than_the_response(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: set_row(t, "behavior_logprobs", 2, t["behavior_logprobs"][2].as_py()[:-1]))
    return args, [
        f"rollout {ctx.rid('rollouts', 2)} has behavior_logprobs of another length than its response_ids"
    ]


@case
def nan_behaviour_logprob(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit(
        "rollouts",
        lambda t: set_row(t, "behavior_logprobs", 4, [float("nan")] + t["behavior_logprobs"][4].as_py()[1:]),
    )
    return args, [f"rollout {ctx.rid('rollouts', 4)} has a NaN or inf behavior log-prob"]


@case
def inf_reward(ctx: Ctx):  # noqa: ANN201
    args = _advantage(ctx)
    ctx.edit("scores", lambda t: set_row(t, "reward", 5, float("inf")))
    return args, [
        f"rollout_id '{ctx.rid('scores', 5)}'",
        "rewards are +/-inf",
        "redo it with `rlhf-batch score CONFIG --iter 0 --force`",
    ]


@case
def scores_part_truncated(ctx: Ctx):  # noqa: ANN201
    args = _advantage(ctx)
    ctx.part("scores").write_bytes(ctx.part("scores").read_bytes()[:1000])
    return args, [str(ctx.part("scores")), "not a readable Parquet file"]


@case
def scores_reward_as_text(ctx: Ctx):  # noqa: ANN201
    args = _advantage(ctx)
    ctx.edit("scores", lambda t: cast(t, "reward", pa.string()))
    return args, [str(ctx.part("scores")), "column 'reward' has type string, expected double"]


@case
def rollouts_row_removed(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: t.slice(1))
    return args, [str(ctx.part("rollouts")), "has 127 rows", "lists 128", "--force"]


@case
def rollouts_row_duplicated(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: pa.concat_tables([t, t.slice(0, 1)]))
    return args, [str(ctx.part("rollouts")), "has 129 rows", "lists 128"]


@case
def rollouts_rollout_id_repeated(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    rid = ctx.rid("rollouts", 0)
    ctx.edit("rollouts", lambda t: set_row(t, "rollout_id", 1, rid))
    return args, [str(layout.folder(ctx.run, 0, "rollouts")), f"rollout_id {rid} occurs more than once"]


@case
def rollouts_finish_reason_unknown(ctx: Ctx):  # noqa: ANN201
    args = _score(ctx)
    ctx.edit("rollouts", lambda t: set_row(t, "finish_reason", 3, "banana"))
    return args, ["column 'finish_reason' holds 'banana' in row 3", "expected one of stop, length"]


@case
def advantages_row_duplicated(ctx: Ctx):  # noqa: ANN201
    args = _train(ctx)
    rid = ctx.rid("advantages", 0)
    ctx.edit("advantages", lambda t: set_row(t, "rollout_id", 1, rid))
    return args, [f"rollout_id {rid} occurs more than once"]


@case
def scores_missing_rows(ctx: Ctx):  # noqa: ANN201
    args = _advantage(ctx)
    ctx.edit("scores", lambda t: t.slice(0, t.num_rows - 3))
    return args, [
        "rollouts have no score row",
        "rollout_id '0000-demo-",
        "redo it with `rlhf-batch score CONFIG --iter 0 --force`",
    ]


@case
def empty_scores(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts")
    empty_stage(ctx, "scores")
    return ["advantage", ctx.config(), "--quiet"], [
        f"iteration 0 ({layout.iter_dir(ctx.run, 0)})",
        "scores are empty (0 rows)",
    ]


@case
def nan_reference_logprob_in_the_advantages(ctx: Ctx):  # noqa: ANN201
    args = _train(ctx)

    def with_ref(t):  # noqa: ANN001, ANN202 - the demo scores without KL: give every row reference log-probs
        return t.set_column(t.schema.get_field_index("ref_logprobs"), "ref_logprobs", t["behavior_logprobs"])

    n = 1
    while ctx.part("advantages", n).exists():
        ctx.edit("advantages", with_ref, n=n)
        n += 1
    ctx.edit(
        "advantages",
        lambda t: set_row(
            with_ref(t), "ref_logprobs", 3, [float("nan")] + t["behavior_logprobs"][3].as_py()[1:]
        ),
    )
    return args, [f"rollout {ctx.rid('advantages', 3)}: column 'ref_logprobs' has a NaN or inf log-prob"]


@case
def advantages_column_missing(ctx: Ctx):  # noqa: ANN201
    args = _train(ctx)
    ctx.edit("advantages", lambda t: t.drop_columns(["advantage"]), n=2)
    return args, [str(ctx.part("advantages", 2)), "missing column 'advantage'"]


@case
def advantages_token_outside_the_vocabulary(ctx: Ctx):  # noqa: ANN201
    args = _train(ctx)
    rid = ctx.rid("advantages", 1)
    ctx.edit("advantages", lambda t: set_row(t, "input_ids", 1, [*t["input_ids"][1].as_py()[:-1], 99999]))
    return args, [
        f"rollout {rid}: column 'input_ids' holds token id 99999",
        "outside the policy's vocabulary",
    ]


# ---------------------------------------------------------------- reward functions
@case
def reward_function_does_not_import(ctx: Ctx):  # noqa: ANN201
    return _score(ctx, score={"reward_functions": ["no_such_module:fn"]}), [
        "score.reward_functions",
        "cannot import 'no_such_module'",
    ]


@case
def reward_function_module_fails_to_import(ctx: Ctx):  # noqa: ANN201
    name = ctx.module("rw_broken", "import no_such_dependency\n")
    return _score(ctx, score={"reward_functions": [f"{name}:fn"]}), [
        f"cannot import '{name}'",
        "No module named 'no_such_dependency'",
    ]


@case
def reward_function_not_in_module(ctx: Ctx):  # noqa: ANN201
    return _score(ctx, score={"reward_functions": ["rlhf_batch.rewards.demo:nope"]}), [
        "has no attribute 'nope'"
    ]


@case
def reward_function_path_without_colon(ctx: Ctx):  # noqa: ANN201
    return _score(ctx, score={"reward_functions": ["rlhf_batch.rewards.demo.letter_count"]}), [
        "'rlhf_batch.rewards.demo.letter_count' is not of the form 'package.module:function'"
    ]


@case
def reward_function_raises(ctx: Ctx):  # noqa: ANN201
    name = ctx.module(
        "rw_raises", "def boom(*, responses, **_):\n    return [1.0 / (r != 'BOOM') for r in responses]\n"
    )
    args = _score(ctx, score={"reward_functions": [f"{name}:boom"]})
    ctx.edit("rollouts", lambda t: set_row(t, "response", 6, "BOOM"))
    return args, [
        f"reward function {name}:boom raised ZeroDivisionError",
        f"(rollout {ctx.rid('rollouts', 6)})",
    ]


@case
def reward_function_returns_the_wrong_count(ctx: Ctx):  # noqa: ANN201
    name = ctx.module("rw_count", "def one(**_):\n    return [1.0]\n")
    return _score(ctx, score={"reward_functions": [f"{name}:one"]}), [
        f"reward function {name}:one returned 1 values for 128 rollouts"
    ]


@case
def reward_function_returns_nan(ctx: Ctx):  # noqa: ANN201
    name = ctx.module("rw_nan", "def nan(*, responses, **_):\n    return [float('nan')] * len(responses)\n")
    args = _score(ctx, score={"reward_functions": [f"{name}:nan"]})
    return args, [f"reward function {name}:nan returned nan for rollout {ctx.rid('rollouts', 0)}"]


@case
def no_reward_at_all(ctx: Ctx):  # noqa: ANN201
    return _score(ctx, score={"reward_functions": []}), [
        "set score.reward_functions, reward_model and/or score.judge_model"
    ]


@case
def reward_function_unknown_convention(ctx: Ctx):  # noqa: ANN201
    return _score(ctx, score={"reward_functions": ["foo:rlhf_batch.rewards.demo:letter_count"]}), [
        "'foo:rlhf_batch.rewards.demo:letter_count': unknown calling convention 'foo' (use trl:, verl: or none)"
    ]


@case
def verl_result_without_score(ctx: Ctx):  # noqa: ANN201
    name = ctx.module(
        "rw_verl",
        "def compute_score(data_source=None, solution_str='', ground_truth=None, extra_info=None):\n    return {'acc': 1.0}\n",
    )
    args = _score(ctx, score={"reward_functions": [f"verl:{name}:compute_score"]})
    return args, [
        f"reward function verl:{name}:compute_score returned a dict without 'score' for rollout "
        f"{ctx.rid('rollouts', 0)} (keys: acc)"
    ]


@case
def reward_paths_missing(ctx: Ctx):  # noqa: ANN201
    return ["validate", ctx.config(score={"reward_paths": ["no_such_dir"]})], [
        f"score.reward_paths: {ctx.tmp / 'no_such_dir'}: directory not found"
    ]


# ---------------------------------------------------------------- validate, hub ids, run directories
@case
def validate_policy_dir_missing(ctx: Ctx):  # noqa: ANN201
    missing = str(ctx.tmp / "no_model")
    return ["validate", ctx.config(policy_model=missing)], [
        f"policy_model: model directory not found: {missing}"
    ]


@case
def validate_model_config_does_not_load(ctx: Ctx):  # noqa: ANN201
    def edit(p: Path) -> None:
        (p / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))

    path = model_copy(ctx, "bad_config", edit)
    return ["validate", ctx.config(policy_model=path)], [f"policy_model: {path}/config.json does not load"]


@case
def validate_prompts_missing(ctx: Ctx):  # noqa: ANN201
    missing = str(ctx.tmp / "none.jsonl")
    return ["validate", ctx.config(generate={"prompts": missing})], [f"{missing}: prompt file not found"]


@case
def validate_prompt_column_missing(ctx: Ctx):  # noqa: ANN201
    return ["validate", ctx.config(generate={"prompt_column": "question"})], [
        str(ctx.assets.prompts),
        "no 'question' or 'messages' column (columns: id, prompt, letter, count)",
    ]


@case
def validate_reward_function_does_not_import(ctx: Ctx):  # noqa: ANN201
    return ["validate", ctx.config(score={"reward_functions": ["no_such_module:fn"]})], [
        "score.reward_functions",
        "cannot import 'no_such_module'",
    ]


@case
def json_array_of_non_objects(ctx: Ctx):  # noqa: ANN201
    path = ctx.write("prompts.json", "[1, 2]")
    return _generate(ctx, generate={"prompts": path}), [f"{path}: item 0 of the JSON array is not an object"]


@case
def hub_id_not_in_the_cache_offline(ctx: Ctx):  # noqa: ANN201
    assert ctx.monkeypatch is not None
    ctx.monkeypatch.setenv("HF_HOME", str(ctx.tmp / "hf"))
    ctx.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return _generate(ctx, policy_model="nobody/no-such-model"), [
        "policy_model: 'nobody/no-such-model' is not a local directory and not in the Hugging Face cache",
        str(ctx.tmp / "hf" / "hub"),
        "hf download nobody/no-such-model",
    ]


@case
def status_of_a_directory_holding_no_run(ctx: Ctx):  # noqa: ANN201
    ctx.run.mkdir()
    return ["status", str(ctx.run)], [f"{ctx.run}: holds no run (no iter=* folder)"]


@case
def sql_with_a_config_whose_run_dir_is_missing(ctx: Ctx):  # noqa: ANN201
    path = ctx.config()
    return ["sql", "SELECT 1", "--config", path], [f"{ctx.run}: run directory not found (run_dir of {path})"]


# ---------------------------------------------------------------- iterations and stage state
@case
def run_lock_is_a_directory(ctx: Ctx):  # noqa: ANN201
    (ctx.run / ".run.lock").mkdir(parents=True)
    return ["run", ctx.config(), "--quiet"], [str(ctx.run / ".run.lock"), "is not a file"]


@case
def report_out_is_a_file(ctx: Ctx):  # noqa: ANN201
    out = ctx.write("report.html", "<html></html>")
    return ["report", "--run-dir", str(ctx.reference), "--out", out], [f"--out {out}", "is a file"]


@case
def iteration_skipped_by_generate(ctx: Ctx):  # noqa: ANN201
    return ["generate", ctx.config(), "--iter", "1", "--quiet"], [
        "iteration 1: iteration 0 has no trained policy",
        "run train --iter 0 first",
    ]


@case
def iteration_skipped_by_score(ctx: Ctx):  # noqa: ANN201
    return ["score", ctx.config(), "--iter", "1", "--quiet"], [
        str(layout.folder(ctx.run, 1, "rollouts")),
        "rollouts are not complete",
    ]


@case
def iteration_skipped_by_advantage(ctx: Ctx):  # noqa: ANN201
    return ["advantage", ctx.config(), "--iter", "2", "--quiet"], [
        str(layout.folder(ctx.run, 2, "rollouts")),
        "run `rlhf-batch generate --iter 2` first",
    ]


@case
def iteration_skipped_by_train(ctx: Ctx):  # noqa: ANN201
    return ["train", ctx.config(), "--iter", "1", "--quiet"], [
        str(layout.folder(ctx.run, 1, "advantages")),
        "run `rlhf-batch advantage --iter 1` first",
    ]


@case
def negative_iteration(ctx: Ctx):  # noqa: ANN201
    return ["generate", ctx.config(), "--iter", "-1", "--quiet"], ["--iter must be >= 0, got -1"]


@case
def complete_stage_with_another_config(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts", "scores")
    return ["score", ctx.config(), "--set", "score.kl_reward_coef=0.5", "--quiet"], [
        str(layout.folder(ctx.run, 0, "scores")),
        "complete with a different config",
        "config.score.kl_reward_coef: 0.05 on disk, 0.5 now",
        "--force",
    ]


@case
def import_file_without_responses(ctx: Ctx):  # noqa: ANN201
    path = prompts(ctx, [{"prompt": "x*1=", "answer": "x"}])
    return ["import", path, "--config", ctx.config()], [path, "missing column 'response'"]


# ---------------------------------------------------------------- eval
@case
def eval_prompts_not_configured(ctx: Ctx):  # noqa: ANN201
    return ["eval", ctx.config(), "--quiet"], [
        "eval.prompts: no held-out prompt file configured",
        "set [eval] prompts",
    ]


@case
def eval_prompts_not_found(ctx: Ctx):  # noqa: ANN201
    missing = str(ctx.tmp / "heldout.jsonl")
    return ["eval", ctx.config(eval={"prompts": missing}), "--quiet"], [missing, "prompt file not found"]


@case
def eval_k_above_n(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(eval={"prompts": str(ctx.assets.prompts), "n": 8, "k": [1, 16]})
    return ["eval", path, "--quiet"], [path, "'eval.k' has k = 16; pass@k needs 1 <= k <= eval.n = 8"]


@case
def eval_without_reward_functions(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(eval={"prompts": str(ctx.assets.prompts)}, score={"reward_functions": []})
    return ["eval", path, "--quiet"], ["eval: no reward function", "eval.reward_functions"]


@case
def eval_prompt_column_clashes(ctx: Ctx):  # noqa: ANN201
    data = prompts(ctx, [{"prompt": "x*1=", "reward": 1.0}])
    return ["eval", ctx.config(eval={"prompts": data}), "--quiet"], [
        data,
        "column 'reward' clashes with an eval column",
    ]


@case
def eval_iteration_without_policy(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(eval={"prompts": str(ctx.assets.prompts)})
    return ["eval", path, "--iter", "1", "--quiet"], [
        "iteration 1: iteration 0 has no trained policy",
        "run train --iter 0 first",
    ]


# ---------------------------------------------------------------- the checks
# the `ctx` fixture (a Ctx per case) is in conftest.py, shared with test_bad_inputs_state.py


def cli(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> tuple[int, str]:
    """`rlhf-batch ARGS` as the console script runs it (but for its last step, `exit_now`);
    (exit code, stderr)."""
    from rlhf_batch.commands.cli import run_cli as main

    monkeypatch.setattr(sys, "argv", ["rlhf-batch", *args])
    capfd.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capfd.readouterr().err


def outputs(files: set[str]) -> list[str]:
    """Stage outputs among new files (bookkeeping such as _started.json and .run.lock is not)."""
    return sorted(
        f for f in files if f.endswith(".parquet") or f.endswith(layout.MANIFEST) or "/policy/" in f
    )


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_with_one_clear_line(
    name: str, ctx: Ctx, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args, named = CASES[name](ctx)
    print(f"{name}: {assert_refused(ctx, capfd, monkeypatch, args, named)}")


def assert_refused(
    ctx: Ctx,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    named: list[str],
) -> str:
    """`rlhf-batch ARGS` exits 1 with one line naming `named`, no traceback, no existing file
    changed and no new output; the line."""
    before = snapshot(ctx.tmp)
    code, err = cli(capfd, monkeypatch, args)
    assert code == 1, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in named:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    after = snapshot(ctx.tmp)
    assert {k: after.get(k) for k in before} == before, "an existing file changed"
    assert outputs(set(after) - set(before)) == []
    return lines[0]


def test_the_catalogue_covers_at_least_30_cases() -> None:
    assert len(CASES) >= 30


@pytest.mark.slow
def test_real_cli_process_one_line_then_traceback_with_debug(ctx: Ctx) -> None:
    args, named = token_id_outside_the_vocabulary(ctx)
    cmd = [sys.executable, "-m", "rlhf_batch"]
    res = subprocess.run([*cmd, *args], capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and named[0] in res.stderr
    res = subprocess.run([*cmd, "--debug", *args], capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" in res.stderr and "SchemaError" in res.stderr


# ---------------------------------------------------------------- what is allowed, and recovery
def test_extra_columns_are_allowed_and_reach_the_reward_functions(ctx: Ctx, capfd, monkeypatch) -> None:
    """schemas.py: required columns exact, extra columns allowed and passed through."""
    name = ctx.module("rw_note", "def note_len(*, note, **_):\n    return [float(len(n)) for n in note]\n")
    args = _score(ctx, score={"reward_functions": [DEMO_REWARD, f"{name}:note_len"]})
    for n in range(3):
        ctx.edit(
            "rollouts",
            lambda t: t.append_column("note", pa.array(["ab" * (i % 3) for i in range(t.num_rows)])),
            n=n,
        )
    code, err = cli(capfd, monkeypatch, args)
    assert code == 0, err
    got = manifests.read_complete(layout.folder(ctx.run, 0, "scores"), SCORES)
    want = manifests.read_complete(layout.folder(ctx.reference, 0, "scores"), SCORES)
    assert got["reward_letter_count"].equals(want["reward_letter_count"])
    # row i of each 128-row part has note "ab" * (i % 3): lengths 0, 2, 4, 0, 2, 4, ...
    assert got["reward_note_len"].to_pylist()[:4] == [0.0, 2.0, 4.0, 0.0]
    shutil.rmtree(
        layout.folder(ctx.run, 0, "scores")
    )  # advantage over the reference scores + an extra column
    ctx.copy("scores")
    ctx.edit("scores", lambda t: t.append_column("comment", pa.array(["x"] * t.num_rows)))
    code, err = cli(capfd, monkeypatch, ["advantage", ctx.config(), "--quiet"])
    assert code == 0, err
    got = manifests.read_complete(layout.folder(ctx.run, 0, "advantages"), ADVANTAGES)
    assert got.equals(manifests.read_complete(layout.folder(ctx.reference, 0, "advantages"), ADVANTAGES))


def test_a_failed_stage_accepts_the_fix_its_message_suggests(ctx: Ctx, capfd, monkeypatch) -> None:
    """The overlong-prompt error says 'set generate.overlong to skip': a re-run with that setting
    must not be refused as 'a partial run with a different config' (it wrote nothing)."""
    path = prompts(
        ctx, [{"id": "a", "prompt": "x*1="}, {"id": "b", "prompt": "x*12="}, {"id": "c", "prompt": "y*2="}]
    )
    args = _generate(ctx, generate={"prompts": path, "max_prompt_tokens": 4, "num_generations": 2})
    code, err = cli(capfd, monkeypatch, args)
    assert code == 1 and "row 1 (prompt_id b) has 5 tokens" in err
    code, err = cli(capfd, monkeypatch, [*args, "--set", "generate.overlong=skip"])
    assert code == 0, err
    m = manifests.manifest(layout.folder(ctx.run, 0, "rollouts"))
    assert m is not None and m["rows"] == 2 * 2  # prompts a and c, 2 samples each
    assert m["prompt_counts"]["prompts_skipped_overlong"] == 1
    assert pc.unique(
        manifests.read_complete(layout.folder(ctx.run, 0, "rollouts"), ROLLOUTS)["prompt_id"]
    ).to_pylist() == ["a", "c"]
