"""structlog set-up: JSON lines when stderr is not a terminal, a readable console otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=_processors(renderer),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # sys.stderr as it is when each event is logged, not when this ran: a stream replaced
        # meanwhile (and closed, as pytest's capture does) must not keep receiving events.
        logger_factory=lambda *args: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _processors(renderer) -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


class _TeeLogger:
    """JSON lines to a file (every event); warnings and errors also to stderr."""

    def __init__(self, file) -> None:
        self._file = file

    def _write(self, message: str, loud: bool) -> None:
        self._file.write(message + "\n")
        self._file.flush()
        if loud:
            print(message, file=sys.stderr, flush=True)  # as it is now (see configure_logging)

    def debug(self, message: str) -> None:
        self._write(message, False)

    info = msg = debug

    def warning(self, message: str) -> None:
        self._write(message, True)

    error = critical = exception = fatal = warn = warning


def log_to_file(path, level: str = "info") -> None:
    """`inflight run`: the structured log goes to RUN_DIR/orchestrator.jsonl as JSON lines (the
    terminal shows the progress display; only warnings and errors reach stderr)."""
    handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the life of the process
    logger = _TeeLogger(handle)
    structlog.configure(
        processors=_processors(structlog.processors.JSONRenderer()),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=lambda *args: logger,
        cache_logger_on_first_use=False,
    )
