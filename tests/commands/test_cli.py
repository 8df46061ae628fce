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
    assert sorted(table) == sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
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
        f"  prompts {demo_prompts} (12 rows, column 'prompt'): ok",
        "  reward function rlhf_batch.rewards.demo:letter_count: ok",
        f"{good}: ok",
    ]
    bad = tmp_path / "bad.toml"
    bad.write_text("[generate]\ntemprature = 0.5\n")
    res = cli("validate", str(bad))
    assert res.returncode == 1
    assert (
        res.stderr.strip()
        == f"error: {bad}: unknown key 'generate.temprature' (did you mean 'generate.temperature'?)"
    )
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
