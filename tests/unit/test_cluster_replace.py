"""When a run on a Ray cluster places a new engine (`orchestrator.cluster.placement.bundles_to_fill`): in
the bundle of an engine lost for good, once Ray has placed that bundle on a node that is alive (a node
that joined offering the engine resource, or one with room), and never without `fleet.replace`, while
the run stops, in a bundle no engine left, or in one being filled already. Pure: no Ray needed."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.cluster.placement import bundles_to_fill

ALIVE = {"node-a": "10.0.0.2", "node-new": "10.0.0.3"}


def decide(**changes) -> list[int]:
    args = dict(replace=True, stopping=False, free={0: ("engine-0", None)}, placing=set(),
                placed={0: "node-new", 1: "node-a"}, alive=ALIVE)
    args.update(changes)
    return bundles_to_fill(**args)


def test_a_lost_engines_bundle_placed_on_a_node_that_joined_gets_an_engine():
    assert decide() == [0]


def test_no_engine_without_fleet_replace():
    assert decide(replace=False) == []


def test_no_engine_while_the_run_stops():
    assert decide(stopping=True) == []


def test_no_room_no_engine_until_a_node_joins():
    # Ray could not place the bundle again (its node died, no other node has the resource): it waits.
    assert decide(placed={1: "node-a"}) == []
    # Ray still names the dead node for it (before it noticed the death): not a node to start on.
    assert decide(placed={0: "node-dead", 1: "node-a"}) == []
    # The node joins; Ray places the bundle there: now.
    assert decide(placed={0: "node-new", 1: "node-a"}) == [0]


def test_a_bundle_held_by_a_serving_engine_is_no_room():
    assert decide(free={}) == []  # bundle 1 is engine-1's: placed and alive, but not free


def test_a_bundle_being_filled_gets_no_second_engine():
    assert decide(placing={0}) == []


def test_every_free_placed_bundle_in_order():
    free = {2: ("engine-2", None), 0: ("engine-0", None), 1: ("engine-1", None)}
    placed = {0: "node-a", 1: "node-gone", 2: "node-new"}
    assert decide(free=free, placed=placed) == [0, 2]


class _Engine:
    def __init__(self) -> None:
        self.asked = 0

    async def answers_again(self) -> bool:
        self.asked += 1
        return True


class _Fleet:
    def __init__(self, engines: dict) -> None:
        self.engines, self.live_version, self.rejoined = engines, 3, []
        self.coordinator = SimpleNamespace(fenced=set(engines))

    async def rejoin(self, engine_id: str) -> bool:
        self.rejoined.append(engine_id)
        self.coordinator.fenced.discard(engine_id)
        return True


async def test_the_rejoin_probe_leaves_alone_an_engine_that_is_joining_or_leaving_for_good():
    """A replacement enters the fleet fenced and `bring_in` brings it to the live version; the probe
    for fenced engines that answer again must not rejoin it meanwhile (it did: the two staged different
    versions and the join failed after `rejoin_s`)."""
    import anyio

    from orchestrator.run.cluster import rejoin_fenced

    joining, returning = _Engine(), _Engine()
    fleet = _Fleet({"engine-2": joining, "engine-0": returning})
    ups = []
    loop = SimpleNamespace(run=SimpleNamespace(fleet=fleet), keeper=SimpleNamespace(busy={"engine-2"}),
                           activation_lock=anyio.Lock(), handle=ups.append)
    with anyio.move_on_after(0.5):
        await rejoin_fenced(loop, probe_s=0.01)
    assert joining.asked == 0 and "engine-2" in fleet.coordinator.fenced
    assert fleet.rejoined == ["engine-0"] and [u.engine for u in ups] == ["engine-0"]
