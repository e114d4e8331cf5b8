"""Progress bars of the replay commands (`inflight stats`, `export`, `replay`): rich, on stderr,
only on a terminal; imported lazily by the handlers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Callable[[str, int | None], Callable[[int], None]]]:
    """Rich progress bars on stderr; `task(name, total)` returns `advance(n)`."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield lambda _name, _total: lambda _n: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        def task(name: str, total: int | None) -> Callable[[int], None]:
            task_id = progress.add_task(name, total=total)
            return lambda n: progress.advance(task_id, n)

        yield task
