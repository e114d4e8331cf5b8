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


# -- growth past `cluster.engines.count` (`growth_step`) ------------------------------------------

def grow(**changes) -> str | None:
    from orchestrator.cluster.placement import growth_step

    args = dict(max_count=3, members=2, starting=0, free=0, stopping=False, pending=False, given_up=False)
    args.update(changes)
    return growth_step(**args)


def test_below_max_count_room_is_asked_for_then_watched():
    from orchestrator.cluster.placement import GROW, WATCH

    assert grow() == GROW  # no request yet: ask Ray for a one-bundle group
    assert grow(pending=True) == WATCH  # asked: look whether a node took it


def test_a_full_fleet_asks_for_nothing_and_gives_back_what_it_asked_for():
    from orchestrator.cluster.placement import RELEASE

    assert grow(members=3) is None
    assert grow(members=2, starting=1) is None  # one past count is starting: that is the third
    assert grow(members=3, pending=True) == RELEASE
    assert grow(max_count=2, members=2) is None  # max_count = count: never grows


def test_a_lost_engines_bundle_is_filled_before_the_fleet_grows():
    from orchestrator.cluster.placement import RELEASE

    # One of two lost, its bundle free: a node that joins must get the replacement, not growth.
    assert grow(members=1, free=1) is None
    assert grow(members=1, free=1, pending=True) == RELEASE


def test_no_growth_while_the_run_stops_or_after_repeated_failed_starts():
    from orchestrator.cluster.placement import RELEASE

    assert grow(stopping=True) is None and grow(stopping=True, pending=True) == RELEASE
    assert grow(given_up=True) is None and grow(given_up=True, pending=True) == RELEASE
