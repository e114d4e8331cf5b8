"""What a module imports, read from its source (one copy, for the house's rooms and the import-circle
tests): every import counts, at module level, inside functions (a lazy import hides a circle from
Python, not from a reader) and by a literal name (`__import__("x.y")`, `importlib.import_module("x.y")`);
only imports under `if TYPE_CHECKING:` are left out, since they never run."""

from __future__ import annotations

import ast
from pathlib import Path


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def literal_import(node: ast.Call) -> str | None:
    """`__import__("a.b", ...)` or `importlib.import_module("a.b")` / `import_module("a.b")`."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if name in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports at run time. A dotted name that is no module counts
    as the nearest module above it (`from pkg.mod import Name` names pkg.mod); one with none above it
    in `modules` (the standard library, a third party, a bare package left out of `modules`) not at all."""
    out: set[str] = set()

    def add(name: str) -> None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from orchestrator.run import loop` names a module
                sub = f"{node.module}.{alias.name}"
                add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Call) and (name := literal_import(node)):
            add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out
