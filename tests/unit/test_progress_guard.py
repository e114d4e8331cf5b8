"""The progress guard (`orchestrator.run.guard.ProgressGuard`), pure: when a run that cannot progress
must stop, and what its one line says."""

from orchestrator.run.guard import ProgressGuard


def guard(**kw) -> ProgressGuard:
    return ProgressGuard(**{"stall_s": 10.0, "max_error_share": 0.9, "window": 20, "started_at": 0.0, **kw})


def errored(g: ProgressGuard, count: int, kind: str = "reward_error", message: str = "m") -> ProgressGuard:
    for _ in range(count):
        g.terminal("errored", kind, message)
    return g


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


def test_a_full_window_of_the_users_errors_stops_after_all_errored_s_not_stall_s():
    g = guard(stall_s=600.0, all_errored_s=60.0)
    for i in range(20):
        g.terminal("errored", "reward_error", f"reward 'never': ValueError: down {i}")
    assert g.nothing_completes()
    assert g.verdict(59.0, trainer_busy=False, waiting_on="x") is None
    assert g.verdict(60.0, trainer_busy=True, waiting_on="x") is None  # a step in progress is its own bound
    assert g.verdict(61.0, trainer_busy=False, waiting_on="x") == (
        "no trainer step for 61s (run.all_errored_s = 60): the last 20 rollouts all errored: "
        "errored(reward_error) 20, e.g. reward 'never': ValueError: down 19")


def test_one_completion_a_window_not_yet_full_or_the_engines_errors_wait_the_whole_stall_s():
    one_completed = errored(guard(stall_s=600.0, all_errored_s=60.0), 19)
    one_completed.terminal("completed")
    not_full = errored(guard(stall_s=600.0, all_errored_s=60.0), 19)
    engines = errored(guard(stall_s=600.0, all_errored_s=60.0), 8, "engine_fenced", "engine e0 lost")
    errored(engines, 8, "engine_died", "engine e0 died mid-request")
    errored(engines, 4, "engine_generate_error", "HTTP 500")
    for g in (one_completed, not_full, engines):
        assert not g.nothing_completes()
        assert g.verdict(300.0, trainer_busy=False, waiting_on="x") is None
        assert g.verdict(600.0, trainer_busy=False, waiting_on="x").startswith("no trainer step for 600s (run.stall_s = 600)")


def test_every_rollout_errored_in_mixed_kinds_names_each_kind_with_its_count():
    g = errored(guard(stall_s=600.0, all_errored_s=30.0), 12, "reward_error", "reward r: KeyError: 'answer'")
    errored(g, 8, "environment_error", "env: RuntimeError: down")
    assert g.failing() is None  # 60% is below max_error_share
    assert g.verdict(31.0, trainer_busy=False, waiting_on="x") == (
        "no trainer step for 31s (run.all_errored_s = 30): the last 20 rollouts all errored: "
        "errored(reward_error) 12, errored(environment_error) 8, e.g. reward r: KeyError: 'answer'")


def test_all_errored_s_is_never_longer_than_stall_s():
    g = errored(guard(stall_s=10.0, all_errored_s=60.0), 20)
    assert g.verdict(10.0, trainer_busy=False, waiting_on="x").startswith(
        "no trainer step for 10s (run.all_errored_s = 10): the last 20 rollouts all errored")


def test_a_batchs_worth_of_errors_in_a_row_is_enough_when_a_batch_is_fewer_than_the_window():
    """A reward that hangs to its timeout errors a rollout every few seconds: a window of 256
    fills in minutes, a batch of 8 does not need to wait for it."""
    g = guard(stall_s=600.0, all_errored_s=60.0, window=20, batch_rollouts=8)
    for _ in range(12):
        g.terminal("completed")
    timeout = "scoring took longer than task.score_timeout_s (2 s)"
    errored(g, 7, "reward_timeout", timeout)
    assert not g.nothing_completes()
    errored(g, 1, "reward_timeout", timeout)
    assert g.nothing_completes()
    assert g.verdict(61.0, trainer_busy=False, waiting_on="x").startswith(
        "no trainer step for 61s (run.all_errored_s = 60): the last 8 rollouts all errored: errored(reward_timeout) 8")
    g.terminal("completed")
    assert not g.nothing_completes() and g.verdict(61.0, trainer_busy=False, waiting_on="x") is None


def test_the_all_errored_clock_counts_from_the_last_completion_when_it_is_later_than_the_last_step():
    """A trainer that waits long for its batches is no error: a short outage of the judge (a batch's
    worth of errors in a row) stops the run only all_errored_s after the last completion."""
    g = guard(stall_s=600.0, all_errored_s=60.0, batch_rollouts=8)
    g.terminal("completed", at=250.0)
    errored(g, 8, "reward_timeout", "scoring took longer than task.score_timeout_s (2 s)")
    assert g.nothing_completes()
    assert g.verdict(300.0, trainer_busy=False, waiting_on="x") is None  # 300 s without a step, 50 since a completion
    assert "the last 8 rollouts all errored" in g.verdict(310.0, trainer_busy=False, waiting_on="x")
