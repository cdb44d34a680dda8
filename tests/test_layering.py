"""One-way stages: walk every import in luminal_num (module level and inside functions, not under
`if TYPE_CHECKING:`) and fail on a cycle between modules or between packages, or on an import in a
forbidden direction (luminal_num/__init__.py states the rule)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "luminal_num"
PKG = "luminal_num"

# Module cycles inside files other branches own; remove an entry when its branch is merged.
ALLOWED_MODULE_CYCLES: list[set[str]] = []

# (importing package, imported package): directions that break the layering.
FORBIDDEN = [
    ("error", "search"),        # error judges Programs from the side and never imports search
    ("codegen", "search"),      # nothing below llir imports search
    ("runtime", "search"),
    ("quant", "search"),
    ("dtypes", "search"),
    ("hlir", "search"),
    ("search", "report"),       # reports read plans; plans never import reports
    ("hlir", "codegen"),        # hlir is the top of the pipeline
    ("codegen", "runtime"),     # the LLIR does not know its backends
    ("codegen", "error"),
    ("runtime", "error"),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The luminal_num modules an import statement loads (a name from a package is its __init__,
    unless the name is itself a submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PKG]
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PKG:
        return []
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        out.append(sub if sub in MODULES else target)
    return out


def _imports() -> dict[str, dict[str, bool]]:
    """module -> {imported module: whether the import sits inside a function}."""
    graph: dict[str, dict[str, bool]] = {}
    for mod, path in MODULES.items():
        edges: dict[str, bool] = {}
        is_pkg = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node):
                for child in node.orelse:
                    visit(child, in_function)
                return
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(mod, is_pkg, node):
                    if target != mod:
                        edges[target] = edges.get(target, True) and in_function
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)
        visit(ast.parse(path.read_text()), False)
        graph[mod] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def _package(mod: str) -> str:
    """The stage a module belongs to: its subpackage (a top-level module is its own stage)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "<top>"


IMPORTS = _imports()


def test_the_walker_sees_the_packages_and_their_imports():
    assert {"luminal_num.search.plan", "luminal_num.codegen.llir", "luminal_num.hlir.graph"} <= set(MODULES)
    assert "luminal_num.codegen.llir" in IMPORTS["luminal_num.search.lower"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_cycles_between_modules():
    """Function-level imports count: an import moved into a function to dodge a cycle is still one."""
    cycles = [c for c in _cycles({m: set(e) for m, e in IMPORTS.items()}) if c not in ALLOWED_MODULE_CYCLES]
    assert not cycles, f"module import cycles: {[sorted(c) for c in cycles]}"


def test_no_import_cycles_between_packages():
    pkgs: dict[str, set[str]] = {}
    for mod, edges in IMPORTS.items():
        for target in edges:
            a, b = _package(mod), _package(target)
            if a != b and "<top>" not in (a, b):
                pkgs.setdefault(a, set()).add(b)
    cycles = _cycles(pkgs)
    assert not cycles, f"package import cycles: {[sorted(c) for c in cycles]}"


@pytest.mark.parametrize("src,dst", FORBIDDEN, ids=[f"{a}-not->{b}" for a, b in FORBIDDEN])
def test_no_forbidden_direction(src, dst):
    bad = sorted(f"{m} -> {t}" for m, edges in IMPORTS.items() for t in edges
                 if _package(m) == src and _package(t) == dst)
    assert not bad, f"{src} must not import {dst}: {bad}"
