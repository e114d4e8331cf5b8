"""The code blocks of docs/tasks.md that start with a file name comment, written out as files."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "tasks.md"
_BLOCK = re.compile(r"```(\w+)\n# ([\w./-]+)\n(.*?)```", re.DOTALL)


def snippets() -> dict[str, str]:
    """{file name: its text} for every named block of docs/tasks.md."""
    return {name: body for _, name, body in _BLOCK.findall(DOC.read_text())}


def write_snippets(directory: Path) -> dict[str, Path]:
    out = {}
    for name, body in snippets().items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        out[name] = path
    (directory / "my_task" / "__init__.py").touch()
    return out
