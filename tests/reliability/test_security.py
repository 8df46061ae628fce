"""A cheap guard over the package source: nothing is unpickled or evaluated, no remote code or
download is switched on in code, reward functions are imported only where the config names them.

The checks walk the syntax tree of every module of rlhf_batch (not its comments and strings);
`test_the_guard_catches_each_pattern` shows each check fires on a bad snippet.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlhf_batch
from rlhf_batch.config import Config

PACKAGE = Path(rlhf_batch.__file__).parent
UNPICKLERS = {"pickle", "cPickle", "dill", "joblib", "shelve", "marshal", "cloudpickle"}
# the modules that import code by a computed name: stage modules by a fixed name, and
# rewards/__init__.py the "package.module:function" paths listed in score.reward_functions,
# envs/pool.py the "module:factory" of generate.environment (in its worker processes)
IMPORT_MODULE_ALLOWED = {"cli.py", "pipeline.py", "rewards/__init__.py", "envs/pool.py"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def problems(source: str, where: str) -> list[str]:
    """Every forbidden construct in `source`, as 'where:line: what', in line order."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        lineno = getattr(node, "lineno", 0)
        line = f"{where}:{lineno}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [(lineno, f"{line}: imports {n}") for n in names if n.split(".")[0] in UNPICKLERS]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if isinstance(func, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
            out.append((lineno, f"{line}: calls {name}()"))
        if name == "load" and owner == "torch" and not _is_true(_keyword(node, "weights_only")):
            out.append((lineno, f"{line}: torch.load without weights_only=True"))
        if name == "load" and owner in ("np", "numpy") and _is_true(_keyword(node, "allow_pickle")):
            out.append((lineno, f"{line}: np.load with allow_pickle=True"))
        if _is_true(_keyword(node, "trust_remote_code")):
            out.append((lineno, f"{line}: trust_remote_code=True literal"))
        if _is_true(_keyword(node, "shell")):
            out.append((lineno, f"{line}: shell=True"))
        if name == "from_pretrained" and not _is_true(_keyword(node, "local_files_only")):
            out.append((lineno, f"{line}: from_pretrained without local_files_only=True"))
        if name == "import_module" and where not in IMPORT_MODULE_ALLOWED:
            out.append((lineno, f"{line}: importlib.import_module outside {sorted(IMPORT_MODULE_ALLOWED)}"))
        if name == "system" and owner == "os":
            out.append((lineno, f"{line}: os.system"))
    return [msg for _, msg in sorted(out, key=lambda x: x[0])]


def test_package_source_has_no_unpickling_eval_or_remote_code() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = [p for f in files for p in problems(f.read_text(), str(f.relative_to(PACKAGE)))]
    assert found == []


def test_the_guard_catches_each_pattern() -> None:
    bad = """
import pickle
from dill import loads
import torch, numpy as np, os, subprocess, importlib
torch.load("x.pt")
torch.load("x.pt", weights_only=False)
np.load("x.npy", allow_pickle=True)
eval("1 + 1")
exec("x = 1")
Model.from_pretrained("dir", trust_remote_code=True, local_files_only=True)
Model.from_pretrained("org/model")
subprocess.run("ls", shell=True)
importlib.import_module(name)
os.system("ls")
"""
    found = problems(bad, "snippet.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports pickle",
        "imports dill",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "np.load with allow_pickle=True",
        "calls eval()",
        "calls exec()",
        "trust_remote_code=True literal",
        "from_pretrained without local_files_only=True",
        "shell=True",
        "importlib.import_module outside ['cli.py', 'envs/pool.py', 'pipeline.py', 'rewards/__init__.py']",
        "os.system",
    ]
    assert problems("torch.load(p, weights_only=True)\nmodel.eval()\n", "ok.py") == []


def test_remote_code_is_off_unless_the_config_turns_it_on() -> None:
    assert Config().trust_remote_code is False


@pytest.mark.slow
def test_stage_processes_run_no_code_from_the_current_directory(make_config, tmp_path: Path) -> None:
    """`run` starts each stage as `python -P -m rlhf_batch ...`: a module file in the directory
    `run` is started from (here a `tqdm.py`, which every stage imports) is never executed."""
    import os
    import subprocess
    import sys

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    marker = tmp_path / "executed"
    (cwd / "tqdm.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('shadowed')\n")
    path, cfg = make_config(generate={"max_new_tokens": 2})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rlhf = Path(sys.executable).parent / "rlhf-batch"
    res = subprocess.run(
        [str(rlhf), "run", str(path), "--quiet"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert not marker.exists()
    assert (Path(cfg.run_dir) / "iter=0000" / "train" / "_manifest.json").is_file()
