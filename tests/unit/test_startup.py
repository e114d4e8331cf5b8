"""The start-up clock of `inflight run`: phases, first rollout, first batch."""

from orchestrator.run.startup import StartupClock, process_age_s


def test_the_process_age_is_known_on_linux_and_counts_from_before_the_clock():
    age = process_age_s()
    assert age is not None and age > 0
    clock = StartupClock()
    assert clock.phases["process_s"] >= age


def test_phases_first_rollout_and_first_batch_are_reported_once_and_in_the_line():
    clock = StartupClock()
    with clock.phase("engines"):
        pass
    with clock.phase("trainer"):
        pass
    assert clock.to_first_rollout_s is None and "no rollout dispatched" in clock.line()
    clock.first_rollout()
    first = clock.to_first_rollout_s
    clock.first_rollout()
    assert clock.to_first_rollout_s == first
    assert clock.first_batch() is True
    assert clock.first_batch() is False
    report = clock.as_dict()
    assert set(report) >= {"process_s", "engines_s", "trainer_s", "to_first_rollout_s", "to_first_batch_s"}
    assert "model_s" not in report  # a phase that did not run is absent, not 0
    assert report["to_first_batch_s"] >= report["to_first_rollout_s"] >= report["process_s"]
    line = clock.line()
    assert line.startswith("first rollout at") and "first batch at" in line
    assert "[trainer" in line and "engines" in line and "model" not in line


def test_a_phase_that_raises_is_still_timed():
    clock = StartupClock()
    try:
        with clock.phase("model"):
            raise ValueError("no model")
    except ValueError:
        pass
    assert "model_s" in clock.phases
