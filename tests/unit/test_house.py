"""The house by role (docs/architecture.md, "The house"): every import of `orchestrator/` goes from a
room to a room its row allows (all of which stand below it), no module of `orchestrator/`, `replay/` or
`transports/` takes part in an import circle, and `orchestrator/` keeps at most six modules at its top.

Every import counts: at module level, inside functions (a lazy import hides a circle from Python, not
from a reader) and by a literal name (`__import__("x.y")`, `importlib.import_module("x.y")`); only
imports under `if TYPE_CHECKING:` are left out, since they never run."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.import_scan import find_cycles, imports_of
import pytest

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "replay", "transports")
GROUND = "ground"


def module_name(path: Path) -> str:
    return ".".join(p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__")


def project_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    modules = set(files) - set(PACKAGES)  # a bare `import orchestrator` is no room's
    return {name: imports_of(path, modules) - {name} for name, path in files.items()}


def documented_rooms() -> list[tuple[str, set[str]]]:
    """(room, rooms it may import) from the table of docs/architecture.md, top floor first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- rooms:", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[3:]:  # the comment, the header, the rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        room = cells[0].strip("`").rstrip("/")
        allowed = {r.strip() for r in cells[-1].split(",")}
        rows.append((room, allowed))
    return rows


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "orchestrator" or len(parts) == 1:
        return None
    if (ROOT / "orchestrator" / parts[1]).is_dir():
        return parts[1]
    return GROUND


def test_the_documented_rooms_are_the_packages_subpackages():
    rooms = [room for room, _ in documented_rooms()]
    on_disk = sorted(p.name for p in (ROOT / "orchestrator").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(r for r in rooms if r != GROUND) == on_disk
    assert rooms[-1] == GROUND


def test_rooms_only_import_rooms_below_them_as_their_row_says():
    rows = documented_rooms()
    floor = {room: i for i, (room, _) in enumerate(rows)}
    for room, allowed in rows:
        below = {r for r, _ in rows[floor[room] + 1:]} | ({GROUND} if room == GROUND else set())
        assert allowed <= below, f"{room} may import {sorted(allowed - below)}, not below it in the table"
    allowed_by_room = dict(rows)
    offenders = []
    for module, deps in project_graph().items():
        source = room_of(module)
        if source is None:
            continue
        for dep in deps:
            target = room_of(dep)
            if target is not None and target != source and target not in allowed_by_room[source]:
                offenders.append(f"{module} -> {dep} ({source} -> {target})")
    assert not offenders, offenders


def test_no_import_circle_in_the_project_literal_imports_included():
    graph = project_graph()
    assert "replay.cli" in graph and "orchestrator.run.loop" in graph
    # the scan sees a literal __import__: commands.subcommands registers the eval command that way
    assert "orchestrator.commands.eval" in graph["orchestrator.commands.subcommands"]
    assert find_cycles(graph) == []


def test_the_checker_sees_a_room_that_imports_upwards(tmp_path):
    """The scan itself: a function-level import of a room above is found."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from orchestrator.run.loop import RunLoop\n"
                   "    __import__('orchestrator.fleet.fleet')\n")
    found = imports_of(src, {"orchestrator.run.loop", "orchestrator.fleet.fleet"})
    assert found == {"orchestrator.run.loop", "orchestrator.fleet.fleet"}


def test_the_top_of_orchestrator_holds_at_most_six_modules_each_named_in_the_ground_row():
    top = sorted(p.stem for p in (ROOT / "orchestrator").glob("*.py"))
    assert len(top) <= 6, top
    ground_row = next(line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
                      if line.startswith(f"| {GROUND} |"))
    assert set(top) - {"__init__"} <= set(re.findall(r"`(\w+)`", ground_row)), ground_row
