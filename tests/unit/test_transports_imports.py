"""No import circle within `transports/`: every import of a `transports.*` module counts, at
module level or inside a function (a lazy import is still a circle), except those under
`if TYPE_CHECKING:`, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "transports"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules`' packages that `path` imports at run time (in functions too)."""
    out: set[str] = set()
    tops = {m.split(".")[0] for m in modules}

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in tops:
                    out.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in tops:
                for alias in node.names:  # `from transports import cli` names a module
                    sub = f"{node.module}.{alias.name}"
                    out.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in out if m in modules and m not in tops}


def import_graph(*packages: str) -> dict[str, set[str]]:
    roots = [PACKAGE.parent / name for name in packages] or [PACKAGE]
    files = {module_name(p): p for root in roots for p in root.rglob("*.py")}
    modules = set(files)
    return {name: imports_of(path, modules) - {name} for name, path in files.items()}


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


def test_the_checker_finds_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_within_transports():
    graph = import_graph()
    assert "transports.refit.plan" in graph and "transports.swap" in graph
    assert find_cycles(graph) == []


def test_no_import_circle_in_the_project():
    """Imports inside functions count too: a lazy import hides a circle from Python, not from a reader."""
    graph = import_graph("orchestrator", "replay", "transports")
    assert "orchestrator.fleet.fleet" in graph and "replay.records" in graph
    assert find_cycles(graph) == []


def test_base_and_the_wire_format_are_leaves():
    graph = import_graph()
    assert graph["transports.errors"] == set()
    assert graph["transports.wire"] <= {"transports.errors"}
    assert graph["transports.refit.views"] <= {"transports.errors"}
    # base only re-exports the leaves (the synchronizer's names resolve lazily, see base.__getattr__)
    assert graph["transports.base"] <= {"transports.errors", "transports.wire", "transports.protocols",
                                        "transports.synchronizer"}
    assert "transports.base" not in graph["transports.synchronizer"]


def test_moved_names_stay_importable_where_they_were():
    from transports.base import (  # noqa: F401
        BucketHeader,
        DeviceHandoverHooks,
        StateDictFn,
        TransportError,
        WeightSynchronizer,
        engine_memory_fraction,
    )
    from transports.bench.transports import PeakRss, RssSampler  # noqa: F401
    from transports.refit.plan import Cast, Fp8BlockQuant, Select, Slice, Transpose, apply_views  # noqa: F401
    from transports.synchronizer import WeightSynchronizer as moved

    assert WeightSynchronizer is moved


def test_transports_and_replay_never_import_orchestrator():
    """The dependency direction of docs/architecture.md, lazy imports included (`transports.cli` imported
    `orchestrator.bench.end_to_end` inside `bench_command`; the orchestrator now hands the
    runner in)."""
    offenders = []
    for package in ("transports", "replay"):
        for path in (PACKAGE.parent / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}" for name in names
                              if name == "orchestrator" or name.startswith("orchestrator.")]
    assert not offenders, offenders


def test_the_end_to_end_bench_runner_is_handed_in_by_the_orchestrator_cli():
    from orchestrator.commands.cli import _bench_end_to_end, build_parser

    args = build_parser().parse_args(["bench", "transports", "--end-to-end"])
    assert args.end_to_end and args.end_to_end_runner is _bench_end_to_end
