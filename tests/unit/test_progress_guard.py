"""The progress guard (`orchestrator.run.guard.ProgressGuard`), pure: when a run that cannot progress
must stop, and what its one line says."""

from orchestrator.run.guard import ProgressGuard


def guard(**kw) -> ProgressGuard:
    return ProgressGuard(**{"stall_s": 10.0, "max_error_share": 0.9, "window": 20, "started_at": 0.0, **kw})


def test_no_verdict_before_the_stall_or_while_the_trainer_holds_a_batch():
    g = guard()
    for _ in range(20):
        g.terminal("errored", "reward_error", "reward f: ValueError: x")
    assert g.verdict(9.9, trainer_busy=False, waiting_on="rollouts") is None
    assert g.verdict(50.0, trainer_busy=True, waiting_on="rollouts") is None  # trainer.step_timeout_s bounds it
    assert g.verdict(10.0, trainer_busy=False, waiting_on="rollouts") is not None


def test_a_dominant_error_kind_is_named_with_an_example():
    g = guard()
    for i in range(19):
        g.terminal("errored", "reward_error", f"reward f: ValueError: x{i}")
    g.terminal("completed")
    verdict = g.verdict(12.0, trainer_busy=False, waiting_on="rollouts")
    assert verdict.startswith("no trainer step for 12s (run.stall_s = 10): 95% of the last 20 rollouts "
                              "ended errored(reward_error), e.g. reward f: ValueError: x18")
    assert g.note() == "95% of the last 20 rollouts errored(reward_error): reward f: ValueError: x18"


def test_below_the_share_the_verdict_says_what_the_run_waits_on():
    g = guard()
    for _ in range(10):
        g.terminal("errored", "reward_error", "m")
        g.terminal("completed")
    assert g.note() is None
    assert g.verdict(11.0, trainer_busy=False, waiting_on="rollouts for a batch (3 in flight)") == \
        "no trainer step for 11s (run.stall_s = 10), waiting on rollouts for a batch (3 in flight)"


def test_a_step_restarts_the_clock_and_drops_do_not_count():
    g = guard()
    g.step(100.0)
    assert g.verdict(105.0, trainer_busy=False, waiting_on="x") is None
    for _ in range(50):
        g.terminal("dropped", "stale")
    g.terminal("errored", "tool_error", "tool t: schema")
    assert g.failing() == ("tool_error", 1.0, 1)  # dropped rollouts say nothing of the user's code
    assert g.verdict(111.0, trainer_busy=False, waiting_on="x").endswith("e.g. tool t: schema")


def test_the_window_forgets_old_errors():
    g = guard(window=4)
    for _ in range(4):
        g.terminal("errored", "reward_error", "m")
    for _ in range(4):
        g.terminal("completed")
    assert g.failing() is None
