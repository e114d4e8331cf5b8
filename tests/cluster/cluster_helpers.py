"""Namespace hosts for the cluster tests: skipped, with the reason printed, where the kernel refuses
them (no root, no network namespaces); everything else is `orchestrator.bench.ray_hosts`, which
`inflight bench cluster` uses too."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.bench.hosts import Hosts, HostsUnavailable
from orchestrator.bench.ray_hosts import RayOnHosts


def make_hosts(n: int, base: Path, model: Path) -> Hosts:
    """n hosts; `base` (the run's parent) visible only on host 0, the model store read-only on all."""
    base.mkdir(parents=True, exist_ok=True)
    try:
        return Hosts(n, hide=[str(base)], hide_except=(0,), read_only=[str(model.parent)])
    except HostsUnavailable as exc:
        pytest.skip(f"namespace hosts unavailable here: {exc}")


def start_cluster(hosts: Hosts, resources: dict[int, dict], later: tuple[int, ...] = ()) -> RayOnHosts:
    return RayOnHosts(hosts, resources=resources).start(later)
