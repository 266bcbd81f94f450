"""The tokenizer package's imports: nothing from the layers above it, and no cycle inside it, late
imports (inside functions) included."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln.tokenizer

PACKAGE = Path(kiln.tokenizer.__file__).parent
ALLOWED_OUTSIDE = {"kiln.errors"}  # the one error type sits below every layer


def _imports(path: Path) -> set[str]:
    """Every kiln module `path` imports, at any depth (a submodule named in `from kiln.x import y`
    counts as kiln.x.y)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kiln"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(
                    sub
                    if (PACKAGE / f"{a.name}.py").exists() and node.module == "kiln.tokenizer"
                    else node.module
                )
    return out


def test_no_imports_from_higher_layers_and_no_cycles():
    graph = {f"kiln.tokenizer.{p.stem}": _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    for module, deps in graph.items():
        outside = {d for d in deps if not d.startswith("kiln.tokenizer") and d not in ALLOWED_OUTSIDE}
        assert not outside, f"{module} imports {sorted(outside)}, above or beside the tokenizer layer"
    # Depth-first search for a cycle among the package's modules (the package itself, __init__,
    # re-exports them and is imported only by the CLI).
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if dep not in graph:
                continue
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
