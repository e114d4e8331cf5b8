"""The one runner of calls into user code (orchestrator/tasks/user_code.py): a plain def in a worker
thread, an async one on the user-code loop, never on the caller's loop; each call under its
timeout, counted from its start, named when it expires; an abandoned thread gives its slot back.
Then what that buys an environment's episodes: a tool that blocks holds its own thread while the
other episodes' steps go on, and one that never returns ends its episode, errored, naming it."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
from transformers import AutoTokenizer

from orchestrator.errors import UserCodeTimeout
from orchestrator.tasks.env import DONE, ToolEnvironment
from orchestrator.tasks.episodes import EnvironmentEpisodes
from orchestrator.tasks.turns import TurnRenderer
from orchestrator.tasks.user_code import UserCode, call_in_thread, current
from tests.agent_helpers import Script


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return TurnRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


# -- the runner ------------------------------------------------------------------------------------
async def test_a_plain_def_runs_in_a_worker_thread_and_an_async_def_on_the_user_code_loop():
    runner = UserCode(threads=2)
    here = threading.current_thread()

    def sync_where():
        return threading.current_thread(), threading.current_thread().daemon

    async def async_where():
        return threading.current_thread(), asyncio.get_running_loop()

    try:
        thread, daemon = await runner.call(sync_where, timeout_s=30, what="sync")
        loop_thread, loop = await runner.call(async_where, timeout_s=30, what="async")
        assert thread != here and daemon, "a plain def never runs on the caller's loop; its thread is a daemon"
        assert loop_thread is not here and loop_thread is not thread and loop is not asyncio.get_running_loop()
        again, _ = await runner.call(async_where, timeout_s=30, what="async")
        assert again is loop_thread, "one user-code loop"
        same, _ = await runner.call(async_where, timeout_s=30, what="async", here=True)
        assert same is here, "here=True (on_loop): awaited on the caller's loop"
    finally:
        runner.close()


async def test_a_thread_past_its_timeout_is_abandoned_named_and_gives_its_slot_back():
    runner = UserCode(threads=1)
    release, started = threading.Event(), threading.Event()

    def stuck():
        started.set()
        release.wait(60)  # blocks its thread, as time.sleep or a socket read would

    try:
        with pytest.raises(UserCodeTimeout) as expired:
            await runner.call(stuck, timeout_s=0.2, what="tool 'stuck'")
        assert expired.value.what == "tool 'stuck'"
        assert str(expired.value).startswith("tool 'stuck' ran past its timeout of 0.2 s; it was at ")
        # where its thread was: the user's line, not the runner's plumbing
        assert expired.value.where.startswith("unit/test_user_code.py:") and expired.value.where.endswith(" in stuck")
        assert isinstance(expired.value, TimeoutError)
        assert started.is_set() and not release.is_set()
        assert runner.busy() == 0, "the abandoned thread holds no slot"
        # the only slot is free although the abandoned thread still runs: the next call runs
        assert await runner.call(lambda: "next", timeout_s=30, what="next") == "next"
    finally:
        release.set()


async def test_a_thread_running_async_code_past_its_timeout_names_where_that_code_waits():
    # An agent's thread runs the agent on an event loop of its own: its stack is that loop's
    # select(); the message names the coroutines waiting instead.
    runner, release = UserCode(threads=1), threading.Event()

    async def waits_for_a_reply():
        while not release.is_set():
            await asyncio.sleep(0.01)

    async def agent():
        await waits_for_a_reply()

    def agents_thread():
        return call_in_thread(agent)

    try:
        with pytest.raises(UserCodeTimeout) as expired:
            await runner.call(agents_thread, timeout_s=0.3, what="the agent")
        where = expired.value.where
        assert " in waits_for_a_reply <- " in where and where.endswith(" in agent"), where
        assert "asyncio/" not in where and "tasks/user_code.py" not in where, where
    finally:
        release.set()


async def test_an_async_call_past_its_timeout_is_cancelled_on_its_loop():
    runner = UserCode(threads=1)
    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(UserCodeTimeout, match="the environment's step ran past"):
            await runner.call(slow, timeout_s=0.2, what="the environment's step")
        with anyio.fail_after(30):
            while not cancelled.is_set():
                await anyio.sleep(0.01)
    finally:
        runner.close()


async def test_the_timeout_counts_from_the_start_of_the_call_not_the_wait_for_a_thread():
    runner = UserCode(threads=1)
    release, holding = threading.Event(), threading.Event()
    results = []

    def hold():
        holding.set()
        release.wait(60)
        return "first"

    async def queued():
        results.append(await runner.call(lambda: "second", timeout_s=1.0, what="second"))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: runner.call(hold, timeout_s=60, what="first"))
            with anyio.fail_after(30):
                while not holding.is_set():
                    await anyio.sleep(0.01)
            tg.start_soon(queued)
            await anyio.sleep(3.0)  # three times the queued call's timeout, waiting for the only thread
            assert results == [], "it waits for the thread"
            release.set()
        assert results == ["second"], "its timeout had not started while it waited"
    finally:
        release.set()


async def test_an_async_call_past_its_timeout_inside_a_tool_names_both_and_the_late_result_is_dropped():
    runner = UserCode(threads=2)
    released = threading.Event()

    def slow_tool():
        released.wait(30)
        return "late"

    async def step():
        return await current().call(slow_tool, timeout_s=60, what="tool 'slow'")

    try:
        with pytest.raises(UserCodeTimeout) as expired:
            await runner.call(step, timeout_s=0.3, what="the environment's step")
        assert str(expired.value).startswith("the environment's step (in tool 'slow') ran past its timeout of 0.3 s")
        released.set()  # the tool returns after its caller gave up: nothing is settled twice
        assert await runner.call(step, timeout_s=30, what="the environment's step") == "late"
    finally:
        released.set()
        runner.close()


async def test_a_timeout_error_the_users_code_raises_is_its_own_not_the_runners():
    def raises():
        raise TimeoutError("the tool's own HTTP timeout")

    with pytest.raises(TimeoutError) as raised:
        await UserCode(threads=1).call(raises, timeout_s=30, what="tool")
    assert not isinstance(raised.value, UserCodeTimeout) and "own HTTP timeout" in str(raised.value)


# -- tools in episodes -----------------------------------------------------------------------------
def call_text(name: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class Fetcher(ToolEnvironment):
    """One tool, `fetch(key)`; the episode's reward 1.0 once the model answers."""

    max_turns = 3
    step_timeout_s = 60.0

    def __init__(self, fetch) -> None:
        self.tools = (fetch,)

    def prompt(self, row: dict) -> str:
        return f"Fetch {row['key']}."

    def score(self, episode, row: dict) -> float:
        return 1.0


async def test_a_blocking_tool_holds_its_own_thread_while_the_other_episodes_finish(renderer):
    release = threading.Event()

    def fetch(key: str) -> str:
        """Fetch a key."""
        if key == "slow":
            release.wait(60)  # blocks its thread, as time.sleep(10) would, until the test lets it go
        return key.upper()

    keys = ["slow"] + [f"k{i}" for i in range(7)]
    episodes = EnvironmentEpisodes(Fetcher(fetch), renderer, user_code=UserCode(threads=len(keys)))
    finished: list[str] = []
    others_done = anyio.Event()

    async def one(key: str) -> None:
        ep = await episodes.run_episode({"key": key}, Script(renderer, [call_text("fetch", key=key), "ok"]), 64)
        assert (ep.ended, ep.reward) == (DONE, 1.0) and {"role": "tool", "content": key.upper()} in ep.messages
        finished.append(key)
        if len(finished) == len(keys) - 1:
            others_done.set()

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for key in keys:
                    tg.start_soon(one, key)
                await others_done.wait()  # never, if the blocked tool held the episodes' loop
                assert "slow" not in finished, "the blocked episode is still in its tool"
                release.set()
        assert finished[-1] == "slow" and sorted(finished[:-1]) == sorted(keys[1:])
    finally:
        release.set()
        episodes.close()


async def test_a_tool_past_the_steps_timeout_ends_the_episode_naming_the_tool(renderer):
    release = threading.Event()

    def fetch(key: str) -> str:
        """Fetch a key."""
        release.wait(60)
        return key

    env = Fetcher(fetch)
    env.step_timeout_s = 0.3
    runner = UserCode(threads=1)
    episodes = EnvironmentEpisodes(env, renderer, user_code=runner)
    try:
        with pytest.raises(TimeoutError, match="tool 'fetch'"):
            await episodes.run_episode({"key": "a"}, Script(renderer, [call_text("fetch", key="a"), "ok"]), 64)
        with anyio.fail_after(30):  # the tool's call, cancelled with its step, gives its slot back
            while runner.busy():
                await anyio.sleep(0.01)
        assert not release.is_set()
    finally:
        release.set()
        episodes.close()


async def test_a_tool_called_outside_a_run_goes_through_the_default_runner():
    from orchestrator.tasks.tools import ToolCall, call_tool

    def where() -> int:
        """Which thread."""
        return threading.get_ident()

    assert current() is current(), "one default per process"
    assert await call_tool({"where": where}, ToolCall("where", {})) != str(threading.get_ident())
