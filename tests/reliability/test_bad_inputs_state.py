"""More of the bad-input catalogue (test_bad_inputs.py, same contract: exit 1, ONE line naming the
file or option, no traceback, no existing file changed, no new output): carried state (the
optimizer state train of iteration 1 continues), LoRA settings and imported token lists."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from rlhf_batch.store import layout
from tests.reliability.test_bad_inputs import Ctx, assert_refused, prompts

Case = Callable[[Ctx], tuple[list[str], list[str]]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


def _train_iteration_1(ctx: Ctx, edit: Callable[[Path], None]) -> list[str]:
    """Train of iteration 1 over the reference run's inputs, iteration 0's optimizer state edited."""
    ctx.copy("train")
    ctx.copy("advantages", it=1)
    shutil.copytree(layout.policy_dir(ctx.reference, 0), layout.policy_dir(ctx.run, 0))
    edit(layout.optimizer_dir(ctx.run, 0))
    return ["train", ctx.config(), "--iter", "1", "--quiet"]


@case
def optimizer_state_missing(ctx: Ctx):  # noqa: ANN201
    args = _train_iteration_1(ctx, shutil.rmtree)
    return args, [str(layout.optimizer_dir(ctx.run, 0)), "is missing", "train.fresh_optimizer=true"]


@case
def optimizer_tensors_missing(ctx: Ctx):  # noqa: ANN201
    args = _train_iteration_1(ctx, lambda d: (d / "optimizer.safetensors").unlink())
    return args, [
        str(layout.optimizer_dir(ctx.run, 0) / "optimizer.safetensors"),
        "unreadable optimizer state",
    ]


@case
def optimizer_tensors_truncated(ctx: Ctx):  # noqa: ANN201
    def cut(d: Path) -> None:
        f = d / "optimizer.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])

    args = _train_iteration_1(ctx, cut)
    return args, [
        str(layout.optimizer_dir(ctx.run, 0) / "optimizer.safetensors"),
        "unreadable optimizer state",
    ]


@case
def optimizer_global_step_not_a_number(ctx: Ctx):  # noqa: ANN201
    def four(d: Path) -> None:
        meta = json.loads((d / "optimizer.json").read_text())
        (d / "optimizer.json").write_text(json.dumps({**meta, "global_step": "four"}))

    args = _train_iteration_1(ctx, four)
    return args, [
        str(layout.optimizer_dir(ctx.run, 0) / "optimizer.json"),
        "'global_step' must be a whole number >= 0, got 'four'",
    ]


@case
def optimizer_tensor_of_another_shape(ctx: Ctx):  # noqa: ANN201
    def reshape(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "optimizer.safetensors"))
        name = next(k for k in sorted(tensors) if k.endswith("/exp_avg") and tensors[k].ndim == 2)
        tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, str(d / "optimizer.safetensors"))

    args = _train_iteration_1(ctx, reshape)
    return args, [str(layout.optimizer_dir(ctx.run, 0) / "optimizer.safetensors"), "exp_avg' has shape"]


@case
def lora_target_module_unknown(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(lora={"enabled": True, "target_modules": ["nonexistent"]})
    return ["run", path, "--quiet"], ["lora.target_modules: 'nonexistent' names no module", "q_proj"]


@case
def lora_init_adapter_of_another_model(ctx: Ctx):  # noqa: ANN201
    """An adapter (r and alpha as configured) made for a model of another hidden size."""
    from peft import LoraConfig, get_peft_model

    from rlhf_batch.models.tiny import init_model

    other = init_model(ctx.tmp / "other", hidden=32, seed=1)
    from rlhf_batch.models.load import load_model

    model = get_peft_model(
        load_model(str(other), "policy"), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    model.save_pretrained(str(ctx.tmp / "adapter"), safe_serialization=True)
    path = ctx.config(lora={"enabled": True, "init_adapter": str(ctx.tmp / "adapter")})
    return ["generate", path, "--quiet"], ["lora.init_adapter", str(ctx.tmp / "adapter"), "does not fit"]


@case
def import_null_inside_response_ids(ctx: Ctx):  # noqa: ANN201
    path = prompts(ctx, [{"prompt": "x*1=", "response": "x", "response_ids": [5, None, 6]}])
    return ["import", path, "--config", ctx.config(), "--quiet"], [
        path,
        "'response_ids' holds a null value in row 1",
    ]


@case
def import_behaviour_logprob_below_float32(ctx: Ctx):  # noqa: ANN201
    path = prompts(
        ctx, [{"prompt": "x*1=", "response": "x", "response_ids": [5], "behavior_logprobs": [-1e300]}]
    )
    return ["import", path, "--config", ctx.config(), "--quiet"], ["behavior_logprobs holds -1e+300"]


@case
def eval_reward_function_not_importable(ctx: Ctx):  # noqa: ANN201
    path = ctx.config(eval={"prompts": str(ctx.assets.prompts), "reward_functions": ["no_such_module:fn"]})
    return ["eval", path, "--quiet"], ["eval.reward_functions: cannot import 'no_such_module'"]


@case
def chat_message_with_null_content(ctx: Ctx):  # noqa: ANN201
    """A chat prompt with a message whose content is null (it would be rendered as an empty turn)."""
    msgs = [{"role": "system", "content": None}, {"role": "user", "content": "x*1="}]
    data = prompts(ctx, [{"id": "a", "messages": msgs}])
    return ["generate", ctx.config(generate={"prompts": data}), "--quiet"], [
        data,
        "row 0: message 0 of 'messages' (system) has null content",
    ]


def _hanging(ctx: Ctx, body: str) -> tuple[list[str], list[str]]:
    name = ctx.module("rw_hang", f"import time\n\ndef hang(*, responses, **_):\n{body}\n")
    args = ["score", ctx.config(score={"reward_functions": [f"{name}:hang"], "reward_timeout": 1}), "--quiet"]
    ctx.copy("rollouts")
    first = ctx.rid("rollouts", 0)
    return args, [f"reward function {name}:hang did not return within 1 s (score.reward_timeout)", first]


@case
def reward_function_sleeps_forever(ctx: Ctx):  # noqa: ANN201
    return _hanging(ctx, "    time.sleep(3600)")


@case
def reward_function_loops_forever(ctx: Ctx):  # noqa: ANN201
    return _hanging(ctx, "    while True:\n        pass")


@pytest.mark.parametrize("name", list(CASES))
def test_bad_state_is_refused_with_one_clear_line(
    name: str,
    ctx: Ctx,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    args, named = CASES[name](ctx)
    print(f"{name}: {assert_refused(ctx, capfd, monkeypatch, args, named)}")
