"""When a run on a Ray cluster places a new engine (`orchestrator.cluster.placement.bundles_to_fill`): in
the bundle of an engine lost for good, once Ray has placed that bundle on a node that is alive (a node
that joined offering the engine resource, or one with room), and never without `fleet.replace`, while
the run stops, in a bundle no engine left, or in one being filled already. Pure: no Ray needed."""

from __future__ import annotations

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
