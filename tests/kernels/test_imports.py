"""The kernel modules import each other downward only: no cycles, no imports inside functions (which is
how a cycle hides), and no re-export shims (a module-level __getattr__ forwarding names elsewhere)."""

import ast
from pathlib import Path

import kiln.kernels

KERNELS = Path(kiln.kernels.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(KERNELS.glob("*.py")) if p.stem != "__init__"}


def _kiln_kernel_imports(node: ast.AST) -> set[str]:
    """The kiln.kernels modules an import statement names (`from kiln.kernels import x` counts x)."""
    out = set()
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module == "kiln.kernels":
            out |= {a.name for a in node.names}
        elif node.module.startswith("kiln.kernels."):
            out.add(node.module.split(".")[2])
    elif isinstance(node, ast.Import):
        out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("kiln.kernels.")}
    return out


def test_kernel_imports_are_top_level_and_acyclic():
    mods = _modules()
    graph = {}
    for name, tree in mods.items():
        top = {n for stmt in tree.body for n in _kiln_kernel_imports(stmt)}
        every = {n for node in ast.walk(tree) for n in _kiln_kernel_imports(node)}
        assert every == top, f"kiln.kernels.{name} imports {sorted(every - top)} inside a function"
        assert not any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in tree.body), (
            f"kiln.kernels.{name} has a module __getattr__ (a re-export shim): import from the real module"
        )
        graph[name] = top & mods.keys()

    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        assert state.get(name) != 1, f"import cycle: {' -> '.join([*path, name])}"
        state[name] = 1
        for dep in sorted(graph[name]):
            visit(dep, [*path, name])
        state[name] = 2

    for name in graph:
        visit(name, [])


def test_shared_helpers_live_in_common():
    """Kernel modules take shared helpers from _common, not from another op's module."""
    ops_importing_ops = {
        (name, dep)
        for name, tree in _modules().items()
        for stmt in tree.body
        for dep in _kiln_kernel_imports(stmt)
        if dep in ("rmsnorm", "layernorm", "swiglu", "softmax", "rope")
    }
    assert not ops_importing_ops, f"helpers imported from op modules: {sorted(ops_importing_ops)}"
