"""The README and docs/ kept true to the code: every `rlhf-batch` command they show parses with
the CLI, every config key they name exists in rlhf_batch.config (and every key of the config is
on docs/configuration.md), every file and module they name exists, and their links resolve.
Each check is a function from a page's text to its problems, shown to find planted mistakes."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer

from rlhf_batch.commands.cli import app
from rlhf_batch.config import Config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STAGES = ("generate", "score", "advantage", "train", "eval", "import")


def config_keys() -> set[str]:
    """Every key of the config: run-level `name` and `section.name`, walked from the dataclasses."""
    keys = set()
    for f in dataclasses.fields(Config):
        table = f.default_factory  # a stage's table is a dataclass made by its default_factory
        if isinstance(table, type) and dataclasses.is_dataclass(table):
            keys |= {f"{f.name}.{g.name}" for g in dataclasses.fields(table)}
        else:
            keys.add(f.name)
    return keys


KEYS = config_keys()
SECTIONS = {k.split(".")[0] for k in KEYS if "." in k}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def inline_spans(text: str) -> list[str]:
    """The inline code spans outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", prose)


# --- commands ---------------------------------------------------------------------------------


def commands(text: str) -> list[tuple[list[str], bool]]:
    """(arguments after `rlhf-batch`, whole) for every command shown: lines of code blocks (whole:
    a complete command line) and inline spans (a command named with some of its options)."""
    found = []
    for lang, body in code_blocks(text):
        if lang in ("", "sh", "bash", "console"):
            for line in body.splitlines():
                line = line.split("  #")[0].strip()  # a comment after the command
                whole = re.match(r"(rlhf-batch|torchrun|python) ", line) is not None
                if not whole:  # a command inside a drawing (`│  rlhf-batch score    rewards ...`)
                    line = re.split(r"(?<=\S)\s{2,}(?=\S)|`", line.split("rlhf-batch", 1)[-1])[0]
                    line = "rlhf-batch" + line if line else ""
                found += [(c, whole) for c in _cli_args(line)]
    for span in inline_spans(text):
        found += [(c, False) for c in _cli_args(span)]
    return found


def _cli_args(line: str) -> list[list[str]]:
    """`rlhf-batch ARGS` or `... -m rlhf_batch ARGS` in `line`, alternatives (a|b) expanded."""
    m = re.search(r"(?:^|\s)(?:rlhf-batch|-m rlhf_batch)\s+(.*)$", line)
    if not m:
        return []
    try:
        words = [w for w in shlex.split(m.group(1)) if w not in ("...", "[--set", "KEY=VALUE", "...]")]
    except ValueError:
        return [[m.group(1)]]  # unbalanced quotes: reported as it is
    out: list[list[str]] = [[]]
    for w in words:
        alts = (
            w.split("|") if re.fullmatch(r"[a-z-]+(\|[a-z-]+)+", w) else list(STAGES) if w == "STAGE" else [w]
        )
        out = [o + [a] for o in out for a in alts]
    return [[_placeholder(w) for w in o] for o in out]


def _placeholder(word: str) -> str:
    """An upper-case placeholder (CONFIG, K, N, RUN) as a value that parses: 1."""
    return "1" if re.fullmatch(r"[A-Z][A-Z_0-9]*", word) else word


def command_problem(args: list[str], whole: bool) -> str | None:
    """Why `rlhf-batch ARGS` does not parse, or None. A whole command is parsed as the CLI
    parses it (options, types, required arguments); a named one only for its command and options."""
    group: Any = typer.main.get_command(app)  # a click group (typer's own copy of click)
    try:
        ctx = group.make_context("rlhf-batch", list(args), resilient_parsing=not whole)
        rest = [*getattr(ctx, "protected_args", ctx._protected_args), *ctx.args]  # the command, its words
        if not rest:
            return None  # `rlhf-batch --help`
        name, cmd, sub = group.resolve_command(ctx, rest)
        if cmd is None or name is None:
            return f"rlhf-batch {' '.join(args)}: no such command"
        if whole:
            cmd.make_context(name, sub, parent=ctx)
        else:
            known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            unknown = [w.split("=")[0] for w in sub if w.startswith("-") and w.split("=")[0] not in known]
            if unknown:
                return f"rlhf-batch {' '.join(args)}: no option {unknown[0]}"
    except typer.Exit:  # --help
        return None
    except Exception as e:  # click's usage errors, which name the option or argument
        if not hasattr(e, "format_message"):
            raise
        return f"rlhf-batch {' '.join(args)}: {e.format_message()}"
    return None


# --- config keys ------------------------------------------------------------------------------

_MENTION = re.compile(r"(?<![\w./-])(" + "|".join(sorted(SECTIONS)) + r")\.([a-z_][a-z0-9_]*)\b(?![./(-]\w)")
_NOT_KEYS = {"py", "png", "sql", "toml", "json", "md", "html", "parquet", "jsonl"}


def key_problems(text: str) -> list[str]:
    """Config keys named in `text` that rlhf_batch.config does not have: `section.key` anywhere,
    `--set KEY=...`, and the keys and tables of TOML blocks (also a heredoc'd config file)."""
    named = {f"{s}.{k}" for s, k in _MENTION.findall(text) if k not in _NOT_KEYS}
    named |= set(re.findall(r"--set[ =]([a-z_][\w.]*)=", text)) - {"key"}  # `--set key=value`: the form
    out = [f"{k}: no such config key" for k in sorted(named - KEYS)]
    for lang, body in code_blocks(text):
        tomls = [body] if lang == "toml" else re.findall(r"<<'?EOF'?\n(.*?)^EOF", body, flags=re.M | re.S)
        for t in tomls:
            out += [
                f"{k}: no such config key (TOML block)" for k in sorted(_toml_keys(tomllib.loads(t)) - KEYS)
            ]
    return out


def _toml_keys(doc: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for k, v in doc.items():
        table = isinstance(v, dict) and prefix + k not in KEYS  # a key may hold a table (advantage.replay)
        keys |= _toml_keys(v, f"{prefix}{k}.") if table else {prefix + k}
    return keys


# --- files, modules, links --------------------------------------------------------------------

_TOP = r"(?:rlhf_batch|tests|pipelines|benchmarks|docs)"
_PATH = re.compile(r"(?<![\w./-])(" + _TOP + r"/[\w./*-]*[\w*])")
_SUBPATH = re.compile(
    r"(?<![\w./-])((?:core|runtime|store|sql|models|rewards|data|engines|observe|stages|commands)/\w+\.(?:py|sql))\b"
)
_MODULE = re.compile(r"(?<![\w./-])(rlhf_batch(?:\.\w+)+(?::\w+)?)")


def path_problems(text: str) -> list[str]:
    """Files and folders of the repository named in `text` that do not exist (a glob must match
    something); `core/kl.py` and the like are read below rlhf_batch/."""
    out = []
    names = [(p, ROOT / p) for p in _PATH.findall(text)]
    names += [(p, ROOT / "rlhf_batch" / p) for p in _SUBPATH.findall(text)]
    for shown, path in names:
        if "*" in shown:
            exists = (
                any(path.parent.glob(path.name)) if "*" not in str(path.parent) else any(ROOT.glob(shown))
            )
        else:
            exists = path.exists()
        if not exists:
            out.append(f"{shown}: no such file or folder")
    return out


def module_problems(text: str) -> list[str]:
    """Dotted names `rlhf_batch.x.y[.attr][:function]` in `text` that do not import or resolve."""
    out = []
    for name in sorted(set(_MODULE.findall(text))):
        module, _, func = name.partition(":")
        parts = module.split(".")
        n = len(parts)
        while n > 1 and not _is_module(".".join(parts[:n])):
            n -= 1
        obj: Any = importlib.import_module(".".join(parts[:n]))
        for attr in [*parts[n:], *([func] if func else [])]:
            if not hasattr(obj, attr):
                out.append(f"{name}: {'.'.join(parts[:n])} has no {attr}")
                break
            obj = getattr(obj, attr)
    return out


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package: `name` is an attribute
        return False


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links `[..](target#anchor)` in `text` whose file or heading does not exist."""
    out = []
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            out.append(f"{page.name}: link {target}: no such file")
        elif anchor and dest.suffix == ".md":
            heads = re.findall(
                r"^#+ (.*)$", re.sub(r"^```.*?^```", "", dest.read_text(), flags=re.M | re.S), re.M
            )
            if anchor not in {_slug(h) for h in heads}:
                out.append(f"{page.name}: link {target}: no heading #{anchor} in {dest.name}")
    return out


# --- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses(page: Path) -> None:
    text = page.read_text()
    problems = [p for args, whole in commands(text) if (p := command_problem(args, whole))]
    assert problems == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_config_key_named_exists(page: Path) -> None:
    assert key_problems(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_and_module_named_exists(page: Path) -> None:
    text = page.read_text()
    assert path_problems(text) + module_problems(text) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page: Path) -> None:
    assert link_problems(page, page.read_text()) == []


def test_the_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", readme))
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}
    assert len(readme.splitlines()) <= 300  # what a newcomer needs first; the reference is in docs/


def config_list_problems(page: str) -> list[str]:
    """The bullets of docs/configuration.md (`- Run level: ...`, `- `[generate]`: ...`) against
    the config: each lists every key of its table, and nothing else outside parentheses."""
    out = []
    for head, table in [("- Run level:", ""), *[(f"- `[{s}]`:", s) for s in sorted(SECTIONS)]]:
        if head not in page:
            out.append(f"{head} no such bullet")
            continue
        bullet = re.split(r"\n- |\n\n", page.split(head, 1)[1], maxsplit=1)[0]
        while re.search(r"\([^()]*\)", bullet):  # what is said about a key, not a key
            bullet = re.sub(r"\([^()]*\)", "", bullet)
        listed = {f"{table}.{w}" if table else w for w in re.findall(r"`([a-z_0-9]+)`", bullet)}
        keys = {k for k in KEYS if (k.startswith(table + ".") if table else "." not in k)}
        out += [f"{k}: not on the configuration page" for k in sorted(keys - listed)]
        out += [f"{k}: listed, but no such config key" for k in sorted(listed - keys)]
    return out


def test_the_configuration_page_lists_every_key_and_only_keys() -> None:
    assert config_list_problems((ROOT / "docs" / "configuration.md").read_text()) == []


def test_the_checks_find_planted_mistakes() -> None:
    # every check passes on correct text and names the planted mistake, so none can pass vacuously
    good = (
        "Set `score.kl_estimator` or `--set train.lr=1e-4`; see `rlhf_batch/core/kl.py`, `core/kl.py`,\n"
        "`rlhf_batch/sql/*.sql`, `rlhf_batch.core.kl.kl_estimate`, `rlhf_batch.rewards.demo:letter_count`\n"
        "and [the stages](stages.md#the-stages).\n\n```sh\nrlhf-batch run my.toml --iterations 3  # note\n```\n"
        "```toml\nseed = 1\n[train]\nlr = 5e-3\n```\n"
    )
    page = ROOT / "docs" / "x.md"
    assert key_problems(good) == [] and path_problems(good) == [] and module_problems(good) == []
    assert link_problems(page, good) == []
    assert [command_problem(a, w) for a, w in commands(good)] == [None]
    page_text = (ROOT / "docs" / "configuration.md").read_text()
    planted = page_text.replace("`ppo_epochs`, `lr`,", "`ppo_epochs`, `lrr`,")
    assert planted != page_text
    assert config_list_problems(planted) == [
        "train.lr: not on the configuration page",
        "train.lrr: listed, but no such config key",
    ]
    assert key_problems("Set `score.kl_estimater`.") == ["score.kl_estimater: no such config key"]
    assert key_problems("x --set train.lrr=1 y") == ["train.lrr: no such config key"]
    assert key_problems("```toml\n[train]\nlrr = 1\n```\n") == ["train.lrr: no such config key (TOML block)"]
    assert key_problems("```toml\nseeds = 1\n```\n") == ["seeds: no such config key (TOML block)"]
    assert path_problems("see `rlhf_batch/schemas.py`") == ["rlhf_batch/schemas.py: no such file or folder"]
    assert path_problems("see `core/kll.py`") == ["core/kll.py: no such file or folder"]
    assert path_problems("`rlhf_batch/sql/*.sqlx`") == ["rlhf_batch/sql/*.sqlx: no such file or folder"]
    assert module_problems("`rlhf_batch.core.kl.kl_estimat`") == [
        "rlhf_batch.core.kl.kl_estimat: rlhf_batch.core.kl has no kl_estimat"
    ]
    assert module_problems("`rlhf_batch.dist.stage_device`") == [
        "rlhf_batch.dist.stage_device: rlhf_batch has no dist"
    ]
    assert link_problems(page, "[a](nope.md)") == ["x.md: link nope.md: no such file"]
    assert link_problems(page, "[a](stages.md#nope)") == [
        "x.md: link stages.md#nope: no heading #nope in stages.md"
    ]
    bad = [command_problem(a, w) for a, w in commands("```sh\nrlhf-batch run my.toml --iteration 3\n```\n")]
    assert bad == [
        "rlhf-batch run my.toml --iteration 3: No such option: --iteration (Possible options: --iterations)"
    ]
    assert command_problem(["score", "--iter", "x"], True) is not None  # a type error
    assert command_problem(["train"], True) is not None  # the config argument is missing
    assert command_problem(["trian", "1"], True) is not None  # no such command
    assert [command_problem(a, w) for a, w in commands("run `rlhf-batch sql --outt f`")] == [
        "rlhf-batch sql --outt f: no option --outt"
    ]
