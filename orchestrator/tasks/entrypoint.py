"""The user's code enters here, by import path ("package.module:attribute"), from the config:
`load_callable` is the one loader (task.entrypoint, task.agent, task.rewards[i].fn).

A user's package on `sys.path`, in the run's working directory or beside the config file needs
no change to this project. The search path's entries are resolved to absolute paths (a later
chdir does not move them), put first on `sys.path` in their order and kept there (the user's
module may import lazily), and the import system's caches are cleared, so a module written
after this process started is found too. An import that fails is a `ConfigError` naming the
config field and the cause, raised at start, before any engine starts.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from orchestrator.errors import ConfigError


def search_path(config_path: str | os.PathLike | None = None) -> list[str]:
    """Where a user's modules are looked for besides sys.path: the working directory and the
    directory of the config file."""
    paths = [os.getcwd()]
    if config_path:
        paths.append(str(Path(config_path).resolve().parent))
    return paths


SEARCH_PATH_FILE = "search_path.json"


def run_search_path(run_dir: str | os.PathLike, config_path: str | os.PathLike | None = None) -> list[str]:
    """The search path of a run: the one its first start recorded in RUN_DIR/search_path.json (so
    `--resume` and `inflight eval RUN_DIR` find the user's modules from any working directory),
    then this start's own. A fresh run records it."""
    import json

    stored_file = Path(run_dir) / SEARCH_PATH_FILE
    stored: list[str] = []
    if stored_file.is_file():
        try:
            stored = [str(p) for p in json.loads(stored_file.read_text())]
        except (OSError, ValueError):
            stored = []
    paths = list(dict.fromkeys(stored + search_path(config_path)))
    if not stored_file.exists() and Path(run_dir).is_dir():
        stored_file.write_text(json.dumps(paths) + "\n")
    return paths


def extend_sys_path(search_path: Sequence[str | os.PathLike]) -> None:
    """Put `search_path` first on sys.path (resolved, in order, kept); see the module's docstring."""
    for entry in reversed(list(search_path)):
        path = str(Path(os.fspath(entry)).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)
    importlib.invalidate_caches()  # a module written after this process started is found too


def load_callable(spec: str, where: str, extra_path: Sequence[str | os.PathLike] | None = None):
    """The object named by "package.module:attribute" (dotted attributes allowed), looked for
    on `extra_path` first; ConfigError naming `where` if it cannot be."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(where, f"must be 'package.module:name', got {spec!r}")
    extend_sys_path(extra_path or [])
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's module is theirs to see, named
        raise ConfigError(where, f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    target = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(where, f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise ConfigError(where, f"{spec!r} is a {type(target).__name__}, not callable")
    return target


def call_factory(factory, args: dict, where: str, **offered):
    """Call an entrypoint factory with the config's `args`, plus each of `offered` (e.g. the
    tokenizer) that its signature names. A bad argument is a ConfigError naming `args`."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in offered.items() if k in params and k not in args}
    if not takes_any:
        unknown = sorted(set(args) - set(params))
        if unknown and params:
            raise ConfigError(f"{where}.args.{unknown[0]}",
                              f"{getattr(factory, '__qualname__', factory)!r} takes no argument {unknown[0]!r} "
                              f"(it takes {sorted(params)})")
    try:
        return factory(**args, **extra)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory failed: name it, no traceback
        raise ConfigError(f"{where}.entrypoint", f"{getattr(factory, '__qualname__', factory)} failed: "
                                                 f"{type(exc).__name__}: {exc}") from None
