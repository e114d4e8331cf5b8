"""`[cluster]`: a run spread over the hosts of an existing Ray cluster (docs/cluster.md).

Ray places and watches processes; it carries no data. Absent, a run is one host, as always."""

from __future__ import annotations

from typing import Literal

import msgspec

from orchestrator.errors import ConfigError

PLACEMENT_STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")


class ClusterEngines(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The engines Ray places: each a vLLM server process on its node, owned by one Ray actor."""

    count: int = 1
    # What one engine reserves on its node, in Ray's resource names: {CPU = 1} here, {GPU = tp} on GPUs.
    resources: dict[str, float] = msgspec.field(default_factory=lambda: {"CPU": 1.0})
    # Only nodes offering this custom resource (`ray start --resources='{"engine": 1}'`) get engines.
    node_resource: str | None = None
    # How the placement group spreads the engines' bundles over nodes (Ray's strategies).
    strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"] = "SPREAD"
    # Grow past `count` up to this many engines, one at a time, as nodes join (or have room) offering
    # the engines' resources; None: `count` (the fleet on the cluster does not grow).
    max_count: int | None = None

    @property
    def most(self) -> int:
        return self.count if self.max_count is None else self.max_count

    def validate(self) -> ClusterEngines:
        if self.count < 1:
            raise ConfigError("cluster.engines.count", f"must be >= 1, got {self.count}")
        if self.max_count is not None and self.max_count < self.count:
            raise ConfigError("cluster.engines.max_count", f"must be >= cluster.engines.count ({self.count}), "
                                                           f"got {self.max_count}")
        for name, amount in self.resources.items():
            if not amount >= 0:
                raise ConfigError(f"cluster.engines.resources.{name}", f"must be >= 0, got {amount}")
        return self


class ClusterTrainer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the trainer runs: node 0 is the orchestrator's host (its rank 0 speaks the trainer link
    and writes the run directory: checkpoints, the step journal, published versions); with
    `nodes` > 1 Ray places nodes 1.. on other hosts, one torchrun each (`trainer.world_size` ranks
    per node), joined at a static rendezvous on node 0."""

    nodes: int = 1
    # What one trainer node (other than node 0) reserves on its host, in Ray's resource names.
    resources: dict[str, float] = msgspec.field(default_factory=lambda: {"CPU": 1.0})
    # Only hosts offering this custom resource (`ray start --resources='{"trainer": 1}'`) get a node.
    node_resource: str | None = None
    # The rendezvous port on node 0; 0: a free one.
    port: int = 0

    def validate(self) -> ClusterTrainer:
        if self.nodes < 1:
            raise ConfigError("cluster.trainer.nodes", f"must be >= 1, got {self.nodes}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("cluster.trainer.port", f"must be in [0, 65535], got {self.port}")
        return self


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: Literal["ray"] = "ray"
    # An existing Ray cluster's address (`ray start --head` printed it), e.g. "10.0.0.1:6379". The
    # run never starts a cluster of its own: this process must run on one of its nodes.
    address: str = ""
    # The address engines on other hosts reach this process at (its weight server); default: the
    # address of this process's Ray node.
    node_ip: str | None = None
    engines: ClusterEngines = ClusterEngines()
    trainer: ClusterTrainer = ClusterTrainer()
    # Longest wait to join the Ray cluster (`ray.init`), for the placement group, and for every engine
    # server to be placed and listening.
    start_timeout_s: float = 600.0
    # An engine that answers neither its health check nor its Ray actor this long (its host's link
    # is down) is fenced; it rejoins at the live version when it answers again.
    unreachable_s: float = 30.0

    def validate(self) -> ClusterConfig:
        if not self.address:
            raise ConfigError("cluster.address", "required: the address of a running Ray cluster (HOST:PORT, as "
                                                 "`ray start --head` printed it)")
        for name in ("start_timeout_s", "unreachable_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cluster.{name}", f"must be > 0, got {getattr(self, name)}")
        self.engines.validate()
        self.trainer.validate()
        return self
