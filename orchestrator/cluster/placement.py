"""One Ray placement group per role (the engines; the trainer's other nodes): its bundles reserved within a
deadline or refused naming what was asked and what the cluster has, actors created in its bundles, the
group released. Light: Ray is imported by the calls, never by the module."""

from __future__ import annotations

from orchestrator.errors import ClusterError
from orchestrator.observe.logging import get_logger

log = get_logger(__name__)


def bundle_of(resources: dict[str, float], node_resource: str | None) -> dict[str, float]:
    """One bundle: the role's resources, and a sliver of the custom resource that pins it to its nodes."""
    bundle = {name: float(amount) for name, amount in resources.items() if amount > 0}
    if node_resource:
        bundle[node_resource] = 0.001
    return bundle


def reserve(name: str, bundle: dict[str, float], count: int, strategy: str, timeout_s: float, what: str):
    """A placement group of `count` copies of `bundle`, ready within `timeout_s`, else ClusterError."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([dict(bundle) for _ in range(count)], strategy=strategy, name=name)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        offered = ray.available_resources()
        release(group)
        raise ClusterError(f"the Ray cluster did not place {count} {what} of {bundle} ({strategy}) within "
                           f"{timeout_s}s; it has {offered} available") from None
    return group


def pending_group(name: str, bundle: dict[str, float]):
    """A placement group of one `bundle`, not waited for: Ray holds it pending until a node has room
    (one joins offering the resource), and places it then (`bundle_nodes` says where)."""
    from ray.util.placement_group import placement_group

    return placement_group([dict(bundle)], strategy="PACK", name=name)


def actor_in(actor_class, group, index: int, bundle: dict[str, float], name: str):
    """`actor_class` (a plain class) made a Ray actor reserving `bundle` in bundle `index` of `group`;
    never restarted by Ray (a lost engine or trainer node is the run's event, not Ray's to repeat)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return ray.remote(actor_class).options(
        name=name, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                             placement_group_bundle_index=index))


def bundle_nodes(group) -> tuple[dict[int, str], dict[str, str]]:
    """Where Ray holds each bundle of `group` now ({index: node id}; a bundle Ray is placing again, its
    node dead, has none), and the nodes alive ({node id: address, None where Ray gave none})."""
    import ray
    from ray.util import placement_group_table

    table = placement_group_table(group)
    placed = {int(index): node for index, node in table.get("bundles_to_node_id", {}).items() if node}
    alive = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}
    return placed, alive


def bundles_to_fill(*, replace: bool, stopping: bool, free: set[int] | dict[int, object], placing: set[int],
                    placed: dict[int, str], alive: dict[str, str | None] | set[str]) -> list[int]:
    """The bundles to place a new engine in now: each held by no engine (its engine was lost for good),
    not being filled already, and placed by Ray on a node that is alive: a node that joined the cluster
    offering the role's resource, or one that had room. None while the run stops, nor without
    `fleet.replace`; a bundle Ray has not placed (no node has room) waits for a node to join."""
    if not replace or stopping:
        return []
    return sorted(i for i in free if i not in placing and placed.get(i) in alive)


GROW, RELEASE, WATCH = "grow", "release", "watch"


def growth_step(*, max_count: int, members: int, starting: int, free: int, stopping: bool,
                pending: bool, given_up: bool) -> str | None:
    """The fleet's growth past `cluster.engines.count`, up to `max_count`, one engine at a time: a
    pending one-bundle group is the demand for the next engine; Ray places it when a node joins
    offering the resource (WATCH: look where it is; the caller starts the engine once it is placed
    on a live node). GROW: ask for that group; RELEASE: give the pending one back, because the run
    stops, the fleet is full (`members` + `starting` engines), or a lost engine's bundle waits for a
    node (`free`: lost bundles no replacement is starting in yet; a replacement comes first, so that
    a node that joins is given to it); None: nothing. A bundle whose replacement is starting holds a
    node already: a second node that joins meanwhile is the growth's."""
    if stopping or given_up or free or members + starting >= max_count:
        return RELEASE if pending else None
    return WATCH if pending else GROW


def release(group) -> None:
    if group is None:
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception as exc:  # noqa: BLE001 - the cluster is gone: nothing to release
        log.warning("cluster.release_failed", error=str(exc))


def kill_actor(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
