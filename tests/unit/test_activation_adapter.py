"""The activation coordinator's `adapter` strategy (LoRA versions): stage = load the adapter on
every engine; live at one instant with no pause, swap or label; a refused load rolls back; a
fenced engine rejoins by loading the live adapter. (Random orders and failures: the property
test in test_activation_coordinator.py runs this strategy too.)"""

from __future__ import annotations

from orchestrator.activation.coordinator import (
    ACTIVATED,
    ROLLED_BACK,
    ActivationCoordinator,
    DropStaged,
    EngineDied,
    Record,
    Stage,
    Staged,
    StageFailed,
    Unfence,
)


def test_the_adapter_strategy_stages_then_makes_the_version_live_with_no_pause_swap_or_label():
    coord = ActivationCoordinator(["a", "b"], strategy="adapter", kv_policy="drain")
    actions = coord.begin(1, 0.0)
    assert sorted(a.engine for a in actions if isinstance(a, Stage)) == ["a", "b"]
    assert coord.handle(Staged(engine="a", at=1.0, version=1)) == []
    assert coord.live_version == 0, "live only once every engine holds the adapter"
    done = coord.handle(Staged(engine="b", at=2.0, version=1))
    assert [type(a) for a in done] == [Record]
    record = done[0]
    assert (record.outcome, record.strategy, record.kv_carried) == (ACTIVATED, "adapter", False)
    assert all(e.pause_s == 0.0 for e in record.engines)
    assert coord.live_version == 1 and coord.idle


def test_the_adapter_strategy_rolls_back_when_one_engine_refuses_the_load():
    coord = ActivationCoordinator(["a", "b"], strategy="adapter", kv_policy="drain")
    coord.begin(1, 0.0)
    coord.handle(Staged(engine="a", at=1.0, version=1))
    out = coord.handle(StageFailed(engine="b", at=2.0, version=1, error="disk"))
    assert sorted(a.engine for a in out if isinstance(a, DropStaged)) == ["a", "b"]
    record = [a for a in out if isinstance(a, Record)][0]
    assert record.outcome == ROLLED_BACK and "disk" in record.message
    assert coord.live_version == 0 and coord.serving == ("a", "b")


def test_a_fenced_engine_rejoins_the_adapter_strategy_by_loading_the_live_adapter():
    coord = ActivationCoordinator(["a", "b"], strategy="adapter", kv_policy="drain", live_version=3)
    coord.handle(EngineDied(engine="b", at=0.0, error="gone"))
    actions = coord.rejoin("b", 1.0)
    assert [a for a in actions if isinstance(a, Stage)] == [Stage(engine="b", version=3)]
    out = coord.handle(Staged(engine="b", at=2.0, version=3))
    assert out == [Unfence(engine="b", version=3)] and coord.serving == ("a", "b")

