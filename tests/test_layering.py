"""kiln's layers import downward only, and no two modules import each other (STYLE.md, "Layout").

Every module under src/kiln is parsed with `ast` (nothing is imported), and every `import kiln.X` /
`from kiln.X import Y` / relative import in it, at module level or inside a function, becomes an edge
from the importing module to the imported one. Two checks on that graph:

- layering: an edge between two packages must go down the table below (or be one of its named
  exceptions). A new top-level package must be placed in the table before it can import or be imported;
- cycles: no strongly connected component of two or more modules (or a module importing itself). A lazy
  import inside a function still counts: it hides a cycle from the interpreter, not from the design.

The checker's functions are tested on small synthetic packages first, so a failure of the last two tests
is a fact about src/kiln, not about the checker.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Layer of each top-level part of kiln (a package or a module directly under src/kiln), lowest first.
# An import may go to a strictly lower layer; the exceptions follow.
LAYERS: dict[str, int] = {
    "": 0,  # kiln/__init__.py
    "errors": 0,
    "config": 0,
    "io": 0,
    "configs": 0,
    "tokenizer": 1,
    "kernels": 1,
    "data": 1,
    "model": 2,
    "quant": 3,
    "dist": 3,
    "train": 4,
    "infer": 4,
    "serve": 5,
    "cli": 6,  # kiln/cli.py, the `kiln` command: may import everything
    "__main__": 7,  # `python -m kiln`: runs the command
}
BASE = 0
# The lowest layer is the project's plumbing: its modules may use each other (a cycle is still an error).
# data sits beside tokenizer and may use it (shards are tokenized text).
EXTRA_ALLOWED = {("data", "tokenizer")}
# profile (ceilings, timing harness, roofline, decode breakdown) measures kernels and the inference
# engine (of a quantized model too: `kiln profile decode --quant`, as kiln.infer loads quantized
# checkpoints), and the layers above it (training's MFU, the CLI) use its ceilings.
PROFILE_MAY_IMPORT = {"", "errors", "config", "io", "configs", "kernels", "model", "quant", "infer"}
PROFILE_USED_BY_FROM_LAYER = LAYERS["train"]
PLACED = set(LAYERS) | {"profile"}


def part_of(module: str) -> str:
    """'kiln.model.layers' -> 'model'; 'kiln' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def allowed(src: str, dst: str) -> bool:
    """May top-level part `src` import part `dst`? (Same part: always.)"""
    if src == dst:
        return True
    if src == "profile":
        return dst in PROFILE_MAY_IMPORT
    if dst == "profile":
        return LAYERS[src] >= PROFILE_USED_BY_FROM_LAYER
    if (src, dst) in EXTRA_ALLOWED:
        return True
    if LAYERS[src] == BASE and LAYERS[dst] == BASE:
        return True
    return LAYERS[dst] < LAYERS[src]


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, e.g. kiln.model.checkpoint
    dst: str  # imported module, e.g. kiln.train.checkpoint
    line: int
    lazy: bool  # inside a function (or class body): runs when called, not at import
    typing_only: bool = False  # under `if TYPE_CHECKING:`: never runs (a layer edge, not a cycle edge)

    def __str__(self) -> str:
        where = ", inside a function" if self.lazy else ""
        where += ", under TYPE_CHECKING" if self.typing_only else ""
        return f"{self.src} -> {self.dst} (line {self.line}{where})"


def discover(root: Path, top: str = "kiln") -> dict[str, Path]:
    """{module name: file} for every .py under root/top (packages as their __init__)."""
    mods = {}
    for path in sorted((root / top).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest known module that `name` names or lies in ('kiln.model.ModelConfig' -> 'kiln.model')."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in mods:
            return cand
        parts.pop()
    return None


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _visit(tree: ast.AST, lazy: bool = False, typing_only: bool = False):
    """Yield (node, lazy, typing_only) for every import node: lazy under a function or class body,
    typing_only in the body of `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, lazy, typing_only
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef)
        if _is_type_checking(node):
            for child in node.body:
                yield from _visit(ast.Module(body=[child], type_ignores=[]), inner, True)
            for child in node.orelse:
                yield from _visit(ast.Module(body=[child], type_ignores=[]), inner, typing_only)
        else:
            yield from _visit(node, inner, typing_only)


def edges_of(module: str, path: Path, mods: dict[str, Path], top: str = "kiln") -> list[Edge]:
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out = []
    for node, lazy, typing_only in _visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:  # relative: from .x import y / from .. import y
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from kiln.x import y`: y may be a submodule (an edge to it) or a name in kiln.x
            targets = [f"{prefix}.{a.name}" if a.name != "*" else prefix for a in node.names]
        for t in targets:
            if t != top and not t.startswith(top + "."):
                continue
            dst = _resolve(t, mods)
            if dst is not None:
                out.append(Edge(module, dst, node.lineno, lazy, typing_only))
    return out


def import_graph(root: Path, top: str = "kiln") -> tuple[dict[str, Path], list[Edge]]:
    mods = discover(root, top)
    return mods, [e for m, p in mods.items() for e in edges_of(m, p, mods, top)]


def layer_violations(edges: list[Edge]) -> list[str]:
    out = []
    for e in edges:
        src, dst = part_of(e.src), part_of(e.dst)
        for part, mod in ((src, e.src), (dst, e.dst)):
            if part not in PLACED:
                out.append(f"{mod}: kiln.{part} has no layer: add it to LAYERS in tests/test_layering.py")
        if src in PLACED and dst in PLACED and not allowed(src, dst):
            out.append(f"{e}: kiln.{src} may not import kiln.{dst} (layers import downward only)")
    return sorted(set(out))


def cycles(mods: dict[str, Path], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of 2+ modules, or a module importing itself (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        if not e.typing_only:
            graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def describe_cycle(comp: list[str], edges: list[Edge]) -> str:
    inside = set(comp)
    lines = [str(e) for e in edges if e.src in inside and e.dst in inside and not e.typing_only]
    return "cycle between " + ", ".join(comp) + ":\n    " + "\n    ".join(sorted(set(lines)))


# ---- the checker on synthetic packages ----


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_checker_finds_upward_imports_lazy_and_relative(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kiln/__init__.py": "",
            "kiln/errors.py": "",
            "kiln/kernels/__init__.py": "",
            "kiln/kernels/rms.py": "from kiln.errors import KilnError\n",
            "kiln/model/__init__.py": "from .layers import Block\n",
            "kiln/model/layers.py": "import kiln.kernels.rms\nfrom kiln.kernels import rms\n",
            "kiln/model/ckpt.py": "def load():\n    from kiln.train.checkpoint import load\n",
            "kiln/train/__init__.py": "",
            "kiln/train/checkpoint.py": "from ..model import layers\n",
            "kiln/data/__init__.py": "",
            "kiln/data/shards.py": "from kiln.tokenizer import Tokenizer\n",
            "kiln/tokenizer/__init__.py": "def f():\n    import kiln.data.shards\n",
            "kiln/profile/__init__.py": "",
            "kiln/profile/bench.py": "from kiln.kernels import rms\nfrom kiln.train import checkpoint\n",
        },
    )
    mods, edges = import_graph(root)
    assert Edge("kiln.model", "kiln.model.layers", 1, False) in edges  # relative, in a package __init__
    assert Edge("kiln.train.checkpoint", "kiln.model.layers", 1, False) in edges  # `from ..model import`
    assert Edge("kiln.model.layers", "kiln.kernels.rms", 2, False) in edges  # submodule named by `from`
    found = layer_violations(edges)
    assert found == [
        "kiln.model.ckpt -> kiln.train.checkpoint (line 2, inside a function): "
        "kiln.model may not import kiln.train (layers import downward only)",
        "kiln.profile.bench -> kiln.train.checkpoint (line 2): "
        "kiln.profile may not import kiln.train (layers import downward only)",
        "kiln.tokenizer -> kiln.data.shards (line 2, inside a function): "
        "kiln.tokenizer may not import kiln.data (layers import downward only)",
    ]
    # data -> tokenizer is allowed; tokenizer -> data (lazily) closes a cycle through the package __init__
    assert cycles(mods, edges) == [["kiln.data.shards", "kiln.tokenizer"]]


def test_checker_rules():
    assert allowed("model", "kernels") and not allowed("kernels", "model")
    assert not allowed("tokenizer", "kernels") and not allowed("kernels", "tokenizer")  # same layer
    assert allowed("data", "tokenizer") and not allowed("tokenizer", "data")
    assert allowed("config", "errors") and allowed("io", "config")  # plumbing uses plumbing
    assert not allowed("train", "infer") and not allowed("infer", "train")
    assert not allowed("quant", "dist") and allowed("train", "dist") and allowed("serve", "infer")
    assert allowed("profile", "kernels") and allowed("profile", "infer") and not allowed("profile", "train")
    assert allowed("train", "profile") and allowed("cli", "profile") and not allowed("kernels", "profile")
    assert all(allowed("cli", p) for p in LAYERS if p != "__main__") and allowed("__main__", "cli")


def test_checker_reports_unplaced_packages(tmp_path):
    root = _tree(tmp_path, {"kiln/__init__.py": "", "kiln/newthing/__init__.py": "import kiln.errors\n",
                            "kiln/errors.py": ""})  # fmt: skip
    _, edges = import_graph(root)
    assert layer_violations(edges) == [
        "kiln.newthing: kiln.newthing has no layer: add it to LAYERS in tests/test_layering.py"
    ]


def test_checker_finds_a_self_import_and_a_cycle_of_three(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kiln/__init__.py": "",
            "kiln/kernels/__init__.py": "",
            "kiln/kernels/a.py": "from kiln.kernels import b\n",
            "kiln/kernels/b.py": "from kiln.kernels.c import x\n",
            "kiln/kernels/c.py": "def f():\n    from . import a\n",
            "kiln/kernels/d.py": "import kiln.kernels.d\n",
            "kiln/kernels/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.kernels import f\n",
            "kiln/kernels/f.py": "from kiln.kernels import e\n",
        },
    )
    mods, edges = import_graph(root)
    assert Edge("kiln.kernels.e", "kiln.kernels.f", 3, False, True) in edges
    # e -> f only under TYPE_CHECKING: never executed, so e <-> f is not a cycle
    assert cycles(mods, edges) == [["kiln.kernels.a", "kiln.kernels.b", "kiln.kernels.c"], ["kiln.kernels.d"]]


# ---- src/kiln ----


@pytest.fixture(scope="module")
def kiln_graph():
    mods, edges = import_graph(SRC)
    assert len(mods) > 20 and len(edges) > 50, "src/kiln not found or not parsed"
    return mods, edges


def test_layers_import_downward_only(kiln_graph):
    _, edges = kiln_graph
    found = layer_violations(edges)
    assert not found, "imports against kiln's layers (STYLE.md):\n  " + "\n  ".join(found)


def test_no_import_cycles(kiln_graph):
    mods, edges = kiln_graph
    found = cycles(mods, edges)
    assert not found, "import cycles:\n  " + "\n  ".join(describe_cycle(c, edges) for c in found)
