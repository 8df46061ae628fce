"""More of the bad-input catalogue (test_bad_inputs.py, same contract: exit 1, ONE line naming the
file or option, no traceback, no existing file changed, no new output): what the machine does to
a run (files this user may not read or write, a path too long, a file where a folder goes), text
that is not UTF-8, a corrupt committed part under `status` and `sql`, bad numbers in options and
environment variables, and what `validate` must find that `generate` would refuse.

Permission cases run in one process of their own, started without the capabilities that let
root read and write anything (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so chmod binds root too."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rlhf_batch.store import layout
from tests.reliability.harness import snapshot
from tests.reliability.test_bad_inputs import Ctx, assert_refused, outputs, prompts

Case = Callable[[Ctx], tuple[list[str], list[str]]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


NOT_UTF8 = b'{"id": "a", "prompt": "x*1=\xff\xfe"}\n'


# ---------------------------------------------------------------- text that is not UTF-8
@case
def prompts_not_utf8_in_generate(ctx: Ctx):  # noqa: ANN201
    path = ctx.tmp / "latin1.jsonl"
    path.write_bytes(NOT_UTF8)
    return ["generate", ctx.config(generate={"prompts": str(path)}), "-q"], [str(path), "not UTF-8 text"]


@case
def prompts_not_utf8_in_validate(ctx: Ctx):  # noqa: ANN201
    path = ctx.tmp / "latin1.jsonl"
    path.write_bytes(NOT_UTF8)
    return ["validate", ctx.config(generate={"prompts": str(path)})], [str(path), "not UTF-8 text"]


@case
def import_file_not_utf8(ctx: Ctx):  # noqa: ANN201
    path = ctx.tmp / "rows.jsonl"
    path.write_bytes(b'{"prompt": "x*1=", "response": "\xff"}\n')
    return ["import", str(path), "--config", ctx.config(), "-q"], [str(path), "not UTF-8 text"]


@case
def sql_query_not_utf8(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts")
    query = os.fsdecode(b"SELECT '\xff'")  # as a shell passes bytes that are not UTF-8
    return ["sql", query, "--run-dir", str(ctx.run)], ["sql: the query is not UTF-8 text"]


# ---------------------------------------------------------------- committed parts and run directories
def _corrupt_part(ctx: Ctx) -> Path:
    ctx.copy("rollouts")
    part = ctx.part("rollouts", 1)
    part.write_bytes(b"not parquet")
    return part


@case
def status_corrupt_committed_part(ctx: Ctx):  # noqa: ANN201
    part = _corrupt_part(ctx)
    return ["status", str(ctx.run)], [str(ctx.run), "cannot read the run", str(part)]


@case
def sql_corrupt_committed_part(ctx: Ctx):  # noqa: ANN201
    part = _corrupt_part(ctx)
    return ["sql", "SELECT count(*) FROM rollouts", "-r", str(ctx.run)], ["cannot read the run", str(part)]


@case
def run_dir_is_a_file(ctx: Ctx):  # noqa: ANN201
    path = ctx.write("run", "a file")
    return ["generate", ctx.config(), "-q"], ["'run_dir'", f"{path} is a file, not a folder"]


@case
def run_dir_name_over_255_bytes(ctx: Ctx):  # noqa: ANN201
    long = str(ctx.tmp / ("r" * 300))
    return ["generate", ctx.config(run_dir=long), "-q"], ["'run_dir' has a name of 300 bytes", "at most 255"]


@case
def report_out_cannot_be_made(ctx: Ctx):  # noqa: ANN201
    return ["report", str(ctx.reference), "--out", "/proc/x"], ["--out /proc/x: cannot make the folder"]


@case
def sql_out_folder_missing(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts")
    out = ctx.tmp / "nonexistent" / "x.csv"
    return ["sql", "SELECT 1", "-r", str(ctx.run), "--out", str(out)], [
        f"the folder {out.parent} does not exist"
    ]


# ---------------------------------------------------------------- options and environment variables
@case
def lock_stale_not_a_number(ctx: Ctx):  # noqa: ANN201
    assert ctx.monkeypatch is not None
    ctx.monkeypatch.setenv("RLHF_BATCH_LOCK_STALE_S", "abc")
    return ["generate", ctx.config(), "-q"], [
        "RLHF_BATCH_LOCK_STALE_S: must be a number of seconds > 0, got 'abc'"
    ]


@case
def uploads_not_a_count(ctx: Ctx):  # noqa: ANN201
    assert ctx.monkeypatch is not None
    ctx.monkeypatch.setenv("RLHF_BATCH_UPLOADS", "-2")
    return ["generate", ctx.config(), "-q"], ["RLHF_BATCH_UPLOADS: must be a whole number >= 0, got '-2'"]


@case
def uploads_a_digit_that_is_not_ascii(ctx: Ctx):  # noqa: ANN201
    assert ctx.monkeypatch is not None
    ctx.monkeypatch.setenv("RLHF_BATCH_UPLOADS", "\u00b2")  # "²".isdigit() is True, int("²") fails
    return ["generate", ctx.config(), "-q"], ["RLHF_BATCH_UPLOADS: must be a whole number >= 0, got '\u00b2'"]


@case
def generate_memory_a_digit_that_is_not_ascii(ctx: Ctx):  # noqa: ANN201
    assert ctx.monkeypatch is not None
    ctx.monkeypatch.setenv("RLHF_BATCH_GENERATE_MEMORY", "1\u00b2")
    return ["generate", ctx.config(generate={"batch_size": "auto"}), "-q"], [
        "RLHF_BATCH_GENERATE_MEMORY: must be a number of bytes >= 1, got '1\u00b2'"
    ]


@case
def environment_module_raises_at_import(ctx: Ctx):  # noqa: ANN201
    (ctx.tmp / "env_broken_at_import.py").write_text("raise RuntimeError('no tool server\\nsecond line')\n")
    config = ctx.config(generate={"environment": "env_broken_at_import:make"})
    return ["generate", config, "-q"], [
        "generate.environment: cannot load 'env_broken_at_import:make' (RuntimeError: no tool server)"
    ]


@case
def topup_negative_iteration(ctx: Ctx):  # noqa: ANN201
    return ["topup", ctx.config(), "--iter", "-3", "-q"], ["--iter must be >= 0, got -3"]


@case
def init_prompts_negative_count(ctx: Ctx):  # noqa: ANN201
    return ["init-prompts", str(ctx.tmp / "p.jsonl"), "--n", "-5"], ["--n: must be >= 1 prompt, got -5"]


@case
def one_generation_per_prompt_in_run(ctx: Ctx):  # noqa: ANN201
    return ["run", ctx.config(generate={"num_generations": 1}), "-q"], [
        "'generate.num_generations' is 1",
        "zero variance",
        "set it >= 2",
    ]


@case
def one_generation_per_prompt_in_advantage(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts", "scores")
    return ["advantage", ctx.config(generate={"num_generations": 1}), "-q"], [
        "'generate.num_generations' is 1"
    ]


@case
def cuda_device_this_machine_lacks(ctx: Ctx):  # noqa: ANN201
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda:0,{max(1, have)}"  # cuda:0,1 on a machine with fewer than 2 GPUs
    return ["validate", ctx.config(generate={"device": device})], [
        f"generate.device: '{device}' needs CUDA GPU {max(1, have)}; this machine has {have}"
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_with_one_clear_line(
    name: str, ctx: Ctx, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args, named = CASES[name](ctx)
    print(f"{name}: {assert_refused(ctx, capfd, monkeypatch, args, named)}")


# ---------------------------------------------------------------- permissions
# (name, what to set up, the command, what the line must name); run in one process without root's
# override of file permissions, each case through `run_cli` as the console script runs it
PermissionCase = Callable[[Ctx], tuple[list[str], list[str]]]
PERMISSION_CASES: dict[str, PermissionCase] = {}


def permission_case(fn: PermissionCase) -> PermissionCase:
    PERMISSION_CASES[fn.__name__] = fn
    return fn


def _unreadable_run(ctx: Ctx) -> Path:
    ctx.copy("rollouts")
    ctx.run.chmod(0)
    return ctx.run


@permission_case
def status_of_an_unreadable_run(ctx: Ctx):  # noqa: ANN201
    return ["status", str(_unreadable_run(ctx))], [str(ctx.run), "Permission denied"]


@permission_case
def sql_over_an_unreadable_run(ctx: Ctx):  # noqa: ANN201
    return ["sql", "SELECT 1", "-r", str(_unreadable_run(ctx))], [str(ctx.run), "Permission denied"]


@permission_case
def report_of_an_unreadable_run(ctx: Ctx):  # noqa: ANN201
    return ["report", str(_unreadable_run(ctx))], [str(ctx.run), "Permission denied"]


@permission_case
def score_in_a_read_only_run(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts")
    for p in [ctx.run, *ctx.run.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return ["score", ctx.config(), "-q"], [str(ctx.run), "Permission denied"]


@permission_case
def generate_with_an_unreadable_prompt_file(ctx: Ctx):  # noqa: ANN201
    path = Path(prompts(ctx, [{"id": "a", "prompt": "x*1="}]))
    path.chmod(0)
    return ["generate", ctx.config(generate={"prompts": str(path)}), "-q"], [str(path), "Permission denied"]


@permission_case
def generate_under_an_unwritable_parent(ctx: Ctx):  # noqa: ANN201
    parent = ctx.tmp / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    return ["generate", ctx.config(run_dir=str(parent / "run")), "-q"], [
        str(parent / "run"),
        "Permission denied",
    ]


@permission_case
def score_with_one_unreadable_part(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts")
    ctx.part("rollouts", 1).chmod(0)
    return ["score", ctx.config(), "-q"], [str(ctx.part("rollouts", 1)), "Permission denied"]


@permission_case
def sql_with_one_unreadable_part(ctx: Ctx):  # noqa: ANN201
    ctx.copy("rollouts")
    ctx.part("rollouts", 1).chmod(0)
    return ["sql", "SELECT count(*) FROM rollouts", "-r", str(ctx.run)], [
        str(ctx.part("rollouts", 1)),
        "Permission denied",
    ]


CASES_SCRIPT = """
import contextlib, io, json, sys, traceback
from rlhf_batch.commands.cli import run_cli

results = []
for args in json.loads(sys.argv[1]):
    sys.argv = ["rlhf-batch", *args]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run_cli()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = -1
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def _without_root_override() -> None:
    """In the child, before exec: drop CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2) from the
    bounding set (PR_CAPBSET_DROP, 24), so the exec'd process gets neither, even as root."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        libc.prctl(24, cap, 0, 0, 0)


def test_files_this_user_may_not_read_or_write_are_one_line_each(
    tmp_path: Path,
    assets,
    reference: Path,  # noqa: ANN001
) -> None:
    cases = {}
    for name, make in PERMISSION_CASES.items():
        ctx = Ctx(tmp_path / name, assets, reference)
        ctx.tmp.mkdir()
        cases[name] = (ctx, *make(ctx))
    before = {name: snapshot_as_owner(c[0].tmp) for name, c in cases.items()}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("RLHF_BATCH_DEBUG", None)
    res = subprocess.run(
        [sys.executable, "-c", CASES_SCRIPT, json.dumps([c[1] for c in cases.values()])],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=_without_root_override if os.geteuid() == 0 else None,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for (name, (ctx, _, named)), (code, err) in zip(cases.items(), results, strict=True):
        assert "Traceback" not in err, f"{name}: {err}"
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), f"{name}: {code} {err}"
        for text in named:
            assert text in lines[0], f"{name}: {text!r} not in {lines[0]!r}"
        after = snapshot_as_owner(ctx.tmp)
        assert {k: after.get(k) for k in before[name]} == before[name], f"{name}: an existing file changed"
        assert outputs(set(after) - set(before[name])) == [], name
        print(f"{name}: {lines[0]}")


def snapshot_as_owner(root: Path) -> dict[str, str]:
    """`snapshot` of a tree some of whose modes deny reading (this process may still read them
    as root; otherwise the modes are opened for the snapshot and put back)."""
    if os.geteuid() == 0:
        return snapshot(root)
    modes = (
        {p: p.stat().st_mode for p in [root, *root.rglob("*")]} if os.access(root, os.R_OK | os.X_OK) else {}
    )
    root.chmod(0o700)
    try:
        for p in [root, *root.rglob("*")]:
            p.chmod((p.stat().st_mode | stat.S_IRUSR | (stat.S_IXUSR if p.is_dir() else 0)) & 0o7777)
        return snapshot(root)
    finally:
        for p, mode in sorted(modes.items(), key=lambda x: -len(str(x[0]))):
            p.chmod(mode & 0o7777)


def test_the_permission_cases_deny_this_process_without_root_override(tmp_path: Path) -> None:
    """The cases above test what they say: without root's override, a mode-0 file cannot be read."""
    f = tmp_path / "secret"
    f.write_text("x")
    f.chmod(0)
    res = subprocess.run(
        [sys.executable, "-c", f"open({str(f)!r}).read()"],
        capture_output=True,
        text=True,
        preexec_fn=_without_root_override if os.geteuid() == 0 else None,
    )
    assert res.returncode == 1 and "PermissionError" in res.stderr


# ---------------------------------------------------------------- what status says after --force
def test_status_calls_stages_stale_once_an_input_is_redone(ctx: Ctx, capfd, monkeypatch) -> None:  # noqa: ANN001
    """A forced score with another config: advantages (whose input it is) and train after it are
    stale, not complete: `run` redoes them."""
    from rlhf_batch.commands.cli import run_cli
    from tests.reliability.test_bad_inputs import cli

    def status() -> dict[str, str]:
        monkeypatch.setattr(sys, "argv", ["rlhf-batch", "status", str(ctx.run)])
        capfd.readouterr()
        run_cli()
        return {
            line.split()[1]: line for line in capfd.readouterr().out.splitlines() if line.startswith("   0")
        }

    ctx.copy("rollouts", "scores", "advantages", "train")
    shutil.copytree(layout.policy_dir(ctx.reference, 0), layout.policy_dir(ctx.run, 0))
    rows = status()
    assert all(" complete " in rows[s] for s in ("rollouts", "scores", "advantages", "train")), rows
    code, err = cli(capfd, monkeypatch, ["score", ctx.config(score={"kl_reward_coef": 0.5}), "--force", "-q"])
    assert code == 0, err
    rows = status()
    assert " complete " in rows["rollouts"] and " complete " in rows["scores"], rows
    assert " stale " in rows["advantages"] and "inputs changed since: iter=0000/scores" in rows["advantages"]
    assert " stale " in rows["train"] and "inputs changed since: advantages (stale)" in rows["train"]


# ---------------------------------------------------------------- validate finds what generate refuses
def _jsonl(ctx: Ctx, name: str, rows: list[object]) -> str:
    return ctx.write(name, "".join(json.dumps(r) + "\n" for r in rows))


def _msgs(*pairs: tuple[object, object]) -> list[dict[str, object]]:
    return [{"role": role, "content": content} for role, content in pairs]


GOOD = {"prompt": "x*1="}
# name -> (the prompt set: file name -> rows, or text), what validate's lines name (one line each)
PROMPT_SETS: dict[str, tuple[dict[str, list[object] | str], list[list[str]]]] = {
    "null_prompt": ({"p.jsonl": [GOOD, {"prompt": None}]}, [["row 1: column 'prompt' is null or empty"]]),
    "empty_prompt": ({"p.jsonl": [{"prompt": ""}, GOOD]}, [["row 0: column 'prompt' is null or empty"]]),
    "trl_null_content": (
        {"p.jsonl": [{"prompt": _msgs(("user", "hi"))}, {"prompt": _msgs(("system", "s"), ("user", None))}]},
        [["row 1: message 1 of 'prompt' (user) has null content"]],
    ),
    "missing_role": (
        {"p.jsonl": [{"prompt": _msgs(("user", "hi"))}, {"prompt": [{"content": "hi"}]}]},
        [["row 1: message 0 of 'prompt' has no role"]],
    ),
    "empty_message_list": (
        {"p.jsonl": [{"prompt": _msgs(("user", "hi"))}, {"prompt": []}]},
        [["row 1: 'prompt' must be a list of {role, content}"]],
    ),
    "unknown_role": (
        {"p.jsonl": [{"prompt": _msgs(("wizard", "abracadabra"), ("user", "hi"))}]},
        [["row 0: message 0 of 'prompt' has role 'wizard'", "roles are system, user, assistant"]],
    ),
    "mixed_plain_and_chat_shards": (
        {"a.jsonl": [GOOD], "b.jsonl": [{"messages": _msgs(("user", "hi"))}]},
        [["b.jsonl: chat prompts, while", "a.jsonl holds text prompts"]],
    ),
    "three_bad_files": (
        {"a.jsonl": "{not json\n", "b.jsonl": "[1, 2\n", "c.jsonl": "{\n"},
        [
            ["a.jsonl: cannot read prompts"],
            ["b.jsonl: cannot read prompts"],
            ["c.jsonl: cannot read prompts"],
        ],
    ),
    "empty_file_in_a_list": ({"a.jsonl": [GOOD], "b.jsonl": ""}, [["b.jsonl: the prompt file is empty"]]),
    "several_bad_rows": (
        {"p.jsonl": [{"prompt": ""}, GOOD, {"prompt": None}]},
        [["row 0: column 'prompt' is null or empty"], ["row 2: column 'prompt' is null or empty"]],
    ),
}


@pytest.mark.parametrize("name", list(PROMPT_SETS))
def test_validate_lists_every_problem_generate_refuses(
    name: str, ctx: Ctx, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`validate` exits 1 with one `error:` line per problem; `generate` refuses the same set with
    one line, its first problem (counting the others)."""
    from tests.reliability.test_bad_inputs import cli

    files, lines = PROMPT_SETS[name]
    paths = [
        ctx.write(f, rows) if isinstance(rows, str) else _jsonl(ctx, f, rows) for f, rows in files.items()
    ]
    config = ctx.config(generate={"prompts": paths if len(paths) > 1 else paths[0], "num_generations": 2})
    code, err = cli(capfd, monkeypatch, ["validate", config])
    assert code == 1 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(lines), err
    for line, named in zip(errors, lines, strict=True):
        assert all(text in line for text in named), (line, named)
    first = assert_refused(ctx, capfd, monkeypatch, ["generate", config, "-q"], lines[0])
    assert (f"and {len(lines) - 1} more problems" in first) == (len(lines) > 1), first


# ---------------------------------------------------------------- the base model's weights
def test_replaced_base_weights_are_refused_not_mixed(ctx: Ctx, capfd, monkeypatch) -> None:  # noqa: ANN001
    """The initial policy's weights replaced between two commands of one run (same config.json,
    same file size): the next stage that reads them refuses with one line; a copy with the same
    bytes (new mtime) is read again and accepted."""
    from rlhf_batch.store.modeldir import BASE_WEIGHTS
    from tests.reliability.test_bad_inputs import _edit_weights, cli, model_copy

    policy = model_copy(ctx, "base", lambda p: None)
    config = ctx.config(policy_model=policy)
    ctx.copy("rollouts")
    code, err = cli(capfd, monkeypatch, ["score", config, "-q"])  # reads the reference: the base
    assert code == 0, err
    record = json.loads((ctx.run / BASE_WEIGHTS).read_text())
    weights = Path(policy) / "model.safetensors"
    assert record[str(Path(policy).resolve())]["model.safetensors"]["bytes"] == weights.stat().st_size
    same = weights.read_bytes()
    weights.write_bytes(same)  # same bytes, new mtime: hashed again, accepted
    code, err = cli(capfd, monkeypatch, ["score", config, "-q", "--force"])
    assert code == 0, err
    shutil.rmtree(layout.folder(ctx.run, 0, "scores"))

    def scale(tensors: dict) -> None:
        name = next(k for k in tensors if k.endswith("weight") and tensors[k].ndim == 2)
        tensors[name] = tensors[name] * 2

    _edit_weights(scale)(Path(policy))
    assert weights.stat().st_size == len(same)
    (ctx.run / layout.LOCK).unlink()  # the earlier commands' lock: it names their pid
    assert_refused(
        ctx,
        capfd,
        monkeypatch,
        ["score", config, "-q"],
        [
            f"ref_model: the weights of {policy} changed since this run read them (model.safetensors",
            BASE_WEIGHTS,
        ],
    )
