"""The summary's reward curve (`orchestrator.observe.progress.sparkline`): one bar a step, the
lowest bar for a reward of 0 (a run that had not learned yet printed a blank curve)."""

from orchestrator.observe.progress import sparkline


def test_every_step_has_a_bar_from_the_floor_to_the_top():
    assert sparkline([0.0, 0.016, 0.031]) == "▁▁▁"
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([-3.0, 2.0]) == "▁█"  # scaled to 0..1, clamped
    assert sparkline([]) == ""
    assert " " not in sparkline([i / 100 for i in range(101)])
