"""The layers of docs/architecture.md, checked on the imports: a module imports only from its own
layer and the layers below it, and no imports close a cycle, between modules or between the
subpackages of one layer (imports inside functions and under TYPE_CHECKING count too)."""

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlhf_batch"
LAYERS = {  # first name below rlhf_batch -> layer
    "core": 0, "errors": 0, "__init__": 0,
    "runtime": 1,
    "config": 2, "store": 2, "sql": 2,
    "models": 3, "rewards": 3, "data": 3, "engines": 3, "observe": 3, "envs": 3,
    "stages": 4,
    "commands": 5, "__main__": 5,
}  # fmt: skip


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        out[".".join(p for p in rel.parts if p != "__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `path` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf_batch"):
            for a in node.names:  # `from pkg import module` names the module, else pkg itself
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlhf_batch"))
    return out


def layer(module: str) -> tuple[int, str]:
    """(layer, subpackage) of a dotted module name."""
    first = module.split(".")[1] if "." in module else "__init__"
    assert first in LAYERS, f"{module}: in no layer; add it to docs/architecture.md and to this test"
    return LAYERS[first], first


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(package: Path) -> list[str]:
    """Every upward import and every cycle, one line each."""
    known = modules(package)
    graph = {m: imports(p, known) - {m} for m, p in known.items()}
    out = []
    for m, targets in graph.items():
        for t in sorted(targets):
            if layer(t)[0] > layer(m)[0]:
                out.append(f"{m} (layer {layer(m)[0]}) imports {t} (layer {layer(t)[0]})")
    out += [f"module cycle: {' -> '.join(c)}" for c in cycles(graph)]
    subs: dict[str, set[str]] = {}
    for m, targets in graph.items():
        for t in targets:
            (lm, sm), (lt, st) = layer(m), layer(t)
            if lm == lt and sm != st:
                subs.setdefault(sm, set()).add(st)
    out += [f"subpackage cycle: {' <-> '.join(c)}" for c in cycles(subs)]
    return out


def test_no_upward_import_and_no_cycle() -> None:
    assert len(modules(PACKAGE)) > 60
    assert violations(PACKAGE) == []


def test_a_planted_upward_import_and_cycle_are_found(tmp_path: Path) -> None:
    copy = tmp_path / "rlhf_batch"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(copy) == []
    kl = copy / "core" / "kl.py"
    kl.write_text(kl.read_text() + "\n\ndef _late() -> None:\n    from rlhf_batch.commands import cli\n")
    found = violations(copy)  # the upward import, and the cycle it closes (cli reaches kl)
    assert found[0] == "rlhf_batch.core.kl (layer 0) imports rlhf_batch.commands.cli (layer 5)"
    assert len(found) == 2 and found[1].startswith("module cycle: rlhf_batch.commands.cli -> ")
    kl.write_text(
        kl.read_text().replace("from rlhf_batch.commands import cli", "from rlhf_batch.core import losses")
    )
    # losses imports kl at module level: kl -> losses -> kl
    assert violations(copy) == ["module cycle: rlhf_batch.core.kl -> rlhf_batch.core.losses"]
    kl.write_text(kl.read_text().replace("from rlhf_batch.core import losses", "pass"))
    demo = copy / "data" / "prompts.py"  # data -> rewards, while rewards -> data
    demo.write_text(demo.read_text() + "\n\ndef _late() -> None:\n    from rlhf_batch.rewards import demo\n")
    assert violations(copy) == ["subpackage cycle: data <-> rewards"]


def test_core_is_pure() -> None:
    # core/ is math on tensors: no I/O, no models, no other part of the package
    known = modules(PACKAGE)
    for path in (PACKAGE / "core").glob("*.py"):
        assert all(m.startswith("rlhf_batch.core") for m in imports(path, known)), path
        text = path.read_text()
        assert "open(" not in text and "transformers" not in text and "pyarrow" not in text, path
