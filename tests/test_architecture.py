"""The layers of the README's "Architecture" section: a module imports only from its own layer and
the layers below it (imports inside functions count too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlhf_batch"
FILES = {  # layer 2: files, models, config
    "config", "errors", "dist", "layout", "atomic", "manifests", "faults", "schemas", "ids",
    "models", "attention", "forward", "sampler", "prompts", "checkpoint", "optim_state", "topup", "tiny", "sql",
    "rewards", "lora", "progress", "tracking", "retention", "engines", "timing",
}  # fmt: skip
COMMANDS = {"cli", "pipeline", "query", "report", "runs", "__main__"}


def layer(module: str) -> int:
    """rlhf_batch.<first>... -> 1 (core), 2 (files and models), 3 (stages), 4 (commands)."""
    first = module.split(".")[1] if "." in module else ""
    if first == "core":
        return 1
    if first in FILES:
        return 2
    if first in ("stages", "executor"):
        return 3
    assert first in COMMANDS, f"{module}: in no layer; add it to the README and to this test"
    return 4


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf_batch"):
            names = (
                [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "rlhf_batch"
                else [node.module]
            )
            out.update(names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlhf_batch"))
    return out


def test_every_module_imports_only_its_layer_and_below() -> None:
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        if module == "rlhf_batch":
            continue
        mine = layer(module)
        for other in imports(path):
            assert layer(other) <= mine, f"{module} (layer {mine}) imports {other} (layer {layer(other)})"
        checked += 1
    assert checked > 30


def test_core_is_pure() -> None:
    # core/ is math on tensors: no I/O, no models, no other part of the package
    for path in (PACKAGE / "core").glob("*.py"):
        assert all(m.startswith("rlhf_batch.core") for m in imports(path)), path
        text = path.read_text()
        assert "open(" not in text and "transformers" not in text and "pyarrow" not in text, path
