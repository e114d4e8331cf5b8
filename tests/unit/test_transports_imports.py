"""No import circle within `transports/`: every import of a `transports.*` module counts, at
module level, inside a function (a lazy import is still a circle) or by a literal name, except those
under `if TYPE_CHECKING:`, which never run (`tests.unit.import_scan`)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.import_scan import find_cycles, imports_of

PACKAGE = Path(__file__).resolve().parents[2] / "transports"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(*packages: str) -> dict[str, set[str]]:
    roots = [PACKAGE.parent / name for name in packages] or [PACKAGE]
    files = {module_name(p): p for root in roots for p in root.rglob("*.py")}
    modules = set(files) - {root.name for root in roots}  # a bare `import transports` is no edge
    return {name: imports_of(path, modules) - {name} for name, path in files.items()}


def test_the_checker_finds_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_scan_names_modules_not_packages_or_names(tmp_path):
    """`from transports import cli` names a module, `from transports.base import X` its module, a
    bare `import transports` nothing; lazy and literal imports count, TYPE_CHECKING ones do not."""
    src = tmp_path / "m.py"
    src.write_text("import transports\nfrom transports import cli\nfrom transports.base import TransportError\n"
                   "if TYPE_CHECKING:\n    import transports.swap\n"
                   "def f():\n    import transports.wire\n    __import__('transports.pull')\n")
    modules = set(import_graph()) - {"transports"}  # as `import_graph` scans: the bare package is no module
    assert imports_of(src, modules) == {"transports.cli", "transports.base", "transports.wire", "transports.pull"}


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
