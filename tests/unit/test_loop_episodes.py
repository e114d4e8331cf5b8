"""Episodes through the run loop (`orchestrator/run/episodes.py`) with the benchmark's
zero-latency fake engine and instant fake trainer, and injected faults: every dispatched episode
still ends in exactly one terminal record, errored with the named kind when its environment or a
turn fails, keeping the turns it had. Real replay log, journal, scheduler, fleet and run loop."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from orchestrator.bench.multi_turn import TURNS, EchoEnvironment, episode_task
from orchestrator.bench.orchestrator import BenchRun
from orchestrator.errors import EngineDeadError
from orchestrator.fleet.fleet import Fleet
from tests.unit.test_loop_faults import check, drive

# models/tiny-rl of the checkout, built when missing (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("checkout_rl_model")
MODEL = "models/tiny-rl"


class Failing(EchoEnvironment):
    """EchoEnvironment with one fault: `how` on turn `at`."""

    def __init__(self, how: str, at: int = 2) -> None:
        self.how, self.at = how, at
        self.step_timeout_s = 0.2 if how == "hang" else 30.0

    async def step(self, episode):
        if episode.turns == self.at:
            if self.how == "raise":
                raise RuntimeError("the environment broke")
            if self.how == "hang":
                await anyio.sleep(60)
            if self.how == "no_reward":
                return [], None, True
        return await super().step(episode)


def episodic_run(tmp_path, env=None, episodes: int = 64, engines=None):
    import msgspec

    from orchestrator.run.loop import RunLoop

    run = BenchRun(tmp_path, 16, episodes, tokens=32)
    task = episode_task(MODEL)
    if env is not None:
        task.runner.env = env
    run.task = task
    run.config = msgspec.structs.replace(run.config, engine=msgspec.structs.replace(
        run.config.engine, max_model_len=1 << 20))
    if engines is not None:
        run.fleet = Fleet(engines)
    run.loop = RunLoop(run)
    return run


@pytest.mark.timeout(180)
async def test_episodes_complete_with_their_environment_spans_and_nan_logprobs(tmp_path):
    run = episodic_run(tmp_path)
    await drive(run)
    _records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps == run.max_steps
    completed = [r for r in rollouts if r.status_name == "completed"]
    assert completed and all(r.turns == TURNS and r.episode_end == "done" for r in completed)
    for r in completed:
        assert len(r.environment_ranges()) == TURNS - 1
        assert np.isnan(r.logprobs()[~r.sampled_mask()]).all()
        assert (r.logprobs()[r.sampled_mask()] == -1.0).all()  # what the fake engine sampled
        assert r.sampled_mask().sum() == TURNS * 32


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how, kind", [("raise", "environment_error"), ("hang", "environment_timeout"),
                                       ("no_reward", "no_reward")])
async def test_an_environment_fault_errors_its_episode_keeping_the_turns_it_had(tmp_path, how, kind):
    run = episodic_run(tmp_path, Failing(how), episodes=32)
    with anyio.fail_after(60):
        await drive(run, stop_after_s=3.0)
    _records, rollouts = check(tmp_path)
    errored = [r for r in rollouts if r.status_name == "errored"]
    assert errored and {r.status.kind for r in errored} == {kind}
    assert all(r.sampled_mask().sum() == 2 * 32 for r in errored)  # the two turns before the fault
    if how == "raise":
        assert all("the environment broke" in r.status.message for r in errored)


class Rambling(EchoEnvironment):
    """Never done: every episode is cut at max_episode_tokens after its second turn."""

    max_turns = 99
    max_episode_tokens = 100


@pytest.mark.timeout(180)
async def test_a_truncated_episode_is_completed_with_the_truncation_reward_never_retried(tmp_path):
    from replay.query import stats_from_log

    run = episodic_run(tmp_path, Rambling(), episodes=32)
    run.task.runner.truncation_reward = 0.25  # task.truncation_reward
    await drive(run)
    _records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps == run.max_steps, "truncated episodes fill the batches"
    assert rollouts and all(r.status_name == "completed" for r in rollouts), "none errored, none retried"
    for r in rollouts:
        assert (r.episode_end, r.finish_reason, r.rewards) == ("max_episode_tokens", "length", {"reward": 0.25})
        assert r.turns == 2 and r.sampled_mask().sum() == 2 * 32
    assert stats_from_log(tmp_path)["truncated_share"] == 1.0


def reporting_engine(engine_id: str, prompt_offset: int = 0, die_on: int | None = None):
    """The fake engine, reporting the prompt it ran (shifted by `prompt_offset`) and dying on
    its `die_on`-th request."""
    from orchestrator.bench.orchestrator import fake_engine

    engine = fake_engine(engine_id, 32)
    inner = engine.generate
    count = [0]

    async def generate(request_id, prompt_token_ids, sampling, cache_salt=None, final_only=False):
        count[0] += 1
        if die_on is not None and count[0] >= die_on:
            raise EngineDeadError(engine_id, "injected death")
        async for chunk in inner(request_id, prompt_token_ids, sampling, cache_salt, final_only):
            if chunk.finished:
                chunk.prompt_token_ids = [t + prompt_offset for t in prompt_token_ids]
            yield chunk

    engine.generate = generate
    return engine


@pytest.mark.timeout(180)
async def test_a_turn_whose_engine_ran_another_prompt_errors_prompt_mismatch(tmp_path):
    run = episodic_run(tmp_path, episodes=32, engines=[reporting_engine("fake-0", prompt_offset=1)])
    await drive(run, stop_after_s=3.0)
    _records, rollouts = check(tmp_path)
    errored = [r for r in rollouts if r.status_name == "errored"]
    assert errored and {r.status.kind for r in errored} == {"prompt_mismatch"}


@pytest.mark.timeout(180)
async def test_the_engine_reporting_the_prompt_it_ran_passes_every_turn(tmp_path):
    run = episodic_run(tmp_path, episodes=32, engines=[reporting_engine("fake-0")])
    await drive(run)
    _records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps == run.max_steps
    assert all(r.status_name == "completed" for r in rollouts)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("step_s", [0.05, 5.0])  # stopped between turns; cancelled mid-step past the grace
async def test_a_stop_ends_each_episode_once_with_the_turns_it_had(tmp_path, step_s):
    class Slow(EchoEnvironment):
        async def step(self, episode):
            await anyio.sleep(step_s)
            return await super().step(episode)

    run = episodic_run(tmp_path, Slow(), episodes=64)
    run.config = __import__("msgspec").structs.replace(run.config, run=__import__("msgspec").structs.replace(
        run.config.run, shutdown_grace_s=0.01))
    await drive(run, stop_after_s=0.3)
    _records, rollouts = check(tmp_path)
    dropped = [r for r in rollouts if r.status_name == "dropped"]
    assert dropped
    kept = [r for r in dropped if r.num_completion_tokens]
    assert kept, "no episode stopped mid-way kept the turns it had"
    assert all(r.sampled_mask().sum() % 32 == 0 and len(r.prompt_tokens()) for r in kept)


@pytest.mark.timeout(180)
async def test_an_episode_whose_engine_dies_between_turns_goes_on_on_another(tmp_path):
    from orchestrator.scheduling import scheduler as sch

    dying = reporting_engine("fake-0", die_on=40)  # dies after its first 39 turns
    run = episodic_run(tmp_path, episodes=64, engines=[dying, reporting_engine("fake-1")])
    run.scheduler = sch.Scheduler(run.config.scheduler, ["fake-0", "fake-1"], max_steps=run.max_steps)
    await drive(run)
    _records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps == run.max_steps
    moved = [r for r in rollouts if r.status_name == "completed" and r.engine_id == "fake-0"]
    assert moved, "no episode begun on the engine that died finished (on the other)"
    assert all(r.turns == TURNS and r.sampled_mask().sum() == TURNS * 32 for r in moved)
    errored = [r for r in rollouts if r.status_name == "errored"]
    # Only episodes whose first turn had not completed error (as single-turn rollouts do); the
    # scheduler replaces them.
    assert all(r.status.kind in ("engine_died", "engine_fenced") and r.turns == 0 for r in errored), [
        (r.status.kind, r.turns) for r in errored]


def calling_engine(engine_id: str, token_ids: list[int]):
    """The fake engine answering every turn with `token_ids` (the fake engine's own tokens
    never spell a tool call)."""
    from orchestrator.bench.orchestrator import fake_engine
    from orchestrator.engines.base import TokenChunk, VersionSpan

    engine = fake_engine(engine_id, len(token_ids))

    async def generate(request_id, prompt_token_ids, sampling, cache_salt=None, final_only=False):
        await anyio.lowlevel.checkpoint()
        yield TokenChunk(list(token_ids), [-1.0] * len(token_ids), finished=True, finish_reason="stop",
                         version_spans=[VersionSpan(engine.version, 0, len(token_ids))])

    engine.generate = generate
    return engine


@pytest.mark.timeout(180)
async def test_a_tool_that_never_returns_errors_its_episode_at_its_timeout_naming_the_tool(tmp_path):
    import threading

    from orchestrator.tasks.env import ToolEnvironment

    release = threading.Event()

    def lookup(key: str) -> str:
        """Look a key up."""
        release.wait(120)  # never returns while the run goes on (the test lets it go at its end)
        return key

    class Lookup(ToolEnvironment):
        tools = (lookup,)
        step_timeout_s = 0.5
        max_episode_tokens = 1 << 20

        def prompt(self, row):
            return "Look up a."

        def score(self, episode, row):
            return 1.0

    call = episode_task(MODEL).renderer.encode('<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>')
    run = episodic_run(tmp_path, Lookup(), episodes=32, engines=[calling_engine("fake-0", call)])
    try:
        with anyio.fail_after(60):
            await drive(run, stop_after_s=3.0)
        user_code = run.task.runner.user_code
        with anyio.fail_after(30):  # every abandoned thread gave its slot back
            while user_code.busy():
                await anyio.sleep(0.01)
    finally:
        release.set()
    _records, rollouts = check(tmp_path)
    errored = [r for r in rollouts if r.status_name == "errored"]
    assert errored and {r.status.kind for r in errored} == {"environment_timeout"}
    assert all("tool 'lookup'" in r.status.message and "0.5 s" in r.status.message for r in errored), [
        r.status.message for r in errored]
    assert all(r.turns == 1 and r.sampled_mask().sum() == len(call) for r in errored), "the turn it had is kept"
