"""NIXL transport availability: one-sided reads where the `nixl` package imports.

On machines without it (every CPU-only machine here) the factory refuses `transport="nixl"`
with `TransportUnavailableError` carrying the reason from `nixl_unavailable_reason()`.
"""

from __future__ import annotations

import importlib


def nixl_unavailable_reason() -> str | None:
    """None when nixl can be used; otherwise why not."""
    try:
        importlib.import_module("nixl")
    except ImportError as exc:
        return f"the nixl package does not import ({exc}); install NIXL (GPU/RDMA machines) to use it"
    except Exception as exc:  # a broken install (missing UCX libraries, ...)
        return f"the nixl package failed to import: {type(exc).__name__}: {exc}"
    return None


def nixl_available() -> bool:
    return nixl_unavailable_reason() is None
