import re
import subprocess
import sys
import time
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from rlhf_batch.commands.cli import app

runner = CliRunner()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_batch", *args], capture_output=True, text=True)


def test_help_lists_every_command_and_imports_nothing_heavy() -> None:
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from rlhf_batch.commands.cli import app; "
            "print(sorted(m for m in ('torch', 'transformers', 'duckdb', 'pyarrow') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "[]"
    res = cli("--help")
    assert res.returncode == 0
    for cmd in (
        "generate",
        "score",
        "advantage",
        "train",
        "run",
        "sql",
        "status",
        "report",
        "init-model",
        "init-prompts",
        "import",
        "validate",
    ):
        assert cmd in res.stdout
    assert time.perf_counter() - t0 < 10  # generous: CI machines vary; the benchmark measures it properly


def test_readme_cli_table_lists_every_command_and_only_real_options() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z-]+)([^`]*)` \|", section, flags=re.M)  # | `generate CONFIG [--iter K]` |
    table = {name: re.findall(r"--[a-z-]+", usage) for name, usage in rows}
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert sorted(table) == sorted(name for name, c in commands.items() if not c.hidden)  # not `lane`
    for name, options in table.items():
        res = runner.invoke(app, [name, "--help"], terminal_width=200)
        assert res.exit_code == 0, res.output
        for opt in options:
            assert opt in res.output, f"README names {opt} for {name}; its --help does not"


def test_init_model_builds_loadable_models_for_both_architectures(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    for arch in ("qwen2", "llama"):
        res = runner.invoke(
            app,
            [
                "init-model",
                str(tmp_path / arch),
                "--arch",
                arch,
                "--hidden",
                "32",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--layers",
                "1",
            ],
        )
        assert res.exit_code == 0, res.output
        model = AutoModelForCausalLM.from_pretrained(tmp_path / arch)
        assert model.config.model_type == arch and model.config.num_hidden_layers == 1
        tok = AutoTokenizer.from_pretrained(tmp_path / arch)
        text = 'Any printable ASCII: ~!@#$%^&*()_+{}|:"<>? 0123456789\n\tabcXYZ'
        ids = tok(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text) and tok.decode(ids) == text  # one token per character, lossless
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    res = runner.invoke(app, ["init-model", str(tmp_path / "rm"), "--reward"])
    assert res.exit_code == 0
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").config.num_labels == 1


def test_init_prompts_writes_the_demo_task(tmp_path: Path) -> None:
    res = runner.invoke(app, ["init-prompts", str(tmp_path / "p.jsonl"), "--n", "7"])
    assert res.exit_code == 0
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    assert len(lines) == 7 and '"prompt"' in lines[0]


def test_validate_and_one_line_errors(tmp_path: Path, tiny_model: Path, demo_prompts: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        f'seed = 1\npolicy_model = "{tiny_model}"\n[generate]\ntemperature = 0.5\nprompts = "{demo_prompts}"\n'
        '[score]\nreward_functions = ["rlhf_batch.rewards.demo:letter_count"]\n'
    )
    res = cli("validate", str(good))
    assert res.returncode == 0 and res.stdout.splitlines() == [
        f"  policy_model {tiny_model}: ok",
        f"  generate.prompts {demo_prompts} (12 rows, ids from 'id'): ok",
        "  score reward function rlhf_batch.rewards.demo:letter_count: ok",
        f"{good}: ok",
    ]
    bad = tmp_path / "bad.toml"
    bad.write_text("[generate]\ntemprature = 0.5\n")
    res = cli("validate", str(bad))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [  # every problem, one line each
        f"error: {bad}: unknown key 'generate.temprature' (did you mean 'generate.temperature'?)",
        "error: policy_model: no model directory configured",
        "error: generate.prompts: no prompt file configured",
    ]
    assert "Traceback" not in res.stderr
    res = cli("--debug", "validate", str(bad))
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_bad_option_values_are_named(tmp_path: Path) -> None:
    res = cli("init-model", str(tmp_path / "m"), "--arch", "gpt9")
    assert res.returncode == 1 and "--arch" in res.stderr and "Traceback" not in res.stderr
    res = cli("generate", str(tmp_path / "none.toml"))
    assert res.returncode == 1 and "config file not found" in res.stderr


def test_usage_errors_are_one_line_without_traceback() -> None:
    cases = {
        ("generate",): "rlhf-batch generate: Missing argument 'config'.",
        ("generate", "c.toml", "--bogus"): "rlhf-batch generate: No such option: --bogus",
        ("score", "c.toml", "--iter", "x"): "rlhf-batch score: Invalid value for '--iter'",
        ("nosuchcmd",): "rlhf-batch: No such command 'nosuchcmd'.",
    }
    for args, expected in cases.items():
        res = cli(*args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2, (args, res.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), (args, res.stderr)


def needs_solution(*, prompts, responses, solution, **_):  # noqa: ANN001, ANN201
    return [0.0] * len(responses)


def test_validate_reports_every_problem_in_one_run(tmp_path: Path, tiny_model: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a", "uid": "x"}\n{"prompt": "b", "uid": "x"}\n{"prompt": "a", "uid": "y"}\n')
    config = tmp_path / "c.toml"
    config.write_text(
        f'policy_model = "{tiny_model}"\niterations = 0\n'
        f'[generate]\nprompts = "{data}"\nid_column = "uid"\ntemprature = 0.5\n'
        '[score]\nreward_functions = ["tests.commands.test_cli:needs_solution", "no_such_module:f"]\n'
        f'[eval]\nprompts = "{tmp_path / "held_out.jsonl"}"\n'
        f'[lora]\nenabled = true\ninit_adapter = "{tmp_path / "no_adapter"}"\ntarget_modules = ["q_proj", "qkv"]\n'
    )
    res = cli("validate", str(config))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    expected = [
        "unknown key 'generate.temprature'",
        "'iterations' must be >= 1",
        "rows 0 and 1 have the same id 'x' in id column 'uid'",
        "held_out.jsonl: prompt file not found",
        "cannot import 'no_such_module'",
        "lora.init_adapter: ",
    ]
    assert len(lines) == len(expected), lines
    for line, needle in zip(lines, expected, strict=True):
        assert line.startswith("error: ") and needle in line, (line, needle)
    data.write_text('{"prompt": "a", "uid": "x"}\n{"prompt": "a", "uid": "y"}\n')  # ids fixed
    (tmp_path / "held_out.jsonl").write_text('{"prompt": "c", "uid": "h"}\n')
    config.write_text(
        f'policy_model = "{tiny_model}"\n[generate]\nprompts = "{data}"\nid_column = "uid"\n'
        '[score]\nreward_functions = ["tests.commands.test_cli:needs_solution"]\n'
        f'[eval]\nprompts = "{tmp_path / "held_out.jsonl"}"\n'
        '[lora]\nenabled = true\ntarget_modules = ["q_proj", "qkv"]\n'
    )
    lines = cli("validate", str(config)).stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert (
        "score.reward_functions: reward function tests.commands.test_cli:needs_solution needs argument 'solution'"
        in lines[0]
    )
    assert "columns: none" in lines[0]
    assert (
        "eval.reward_functions: reward function tests.commands.test_cli:needs_solution needs argument"
        in lines[1]
    )
    assert "lora.target_modules: 'qkv' not in" in lines[2] and "q_proj" in lines[2]
