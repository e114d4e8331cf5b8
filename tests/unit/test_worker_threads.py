"""Plain-`def` user code's worker threads are kept between calls (`worker_threads`): reused, never
while a call still runs on them, each call in an empty context, idle ones ending."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from orchestrator.errors import UserCodeTimeout
from orchestrator.tasks import worker_threads
from orchestrator.tasks.user_code import UserCode, call_in_thread

pytestmark = pytest.mark.timeout(60)

MARK: contextvars.ContextVar[str] = contextvars.ContextVar("mark")


async def test_calls_in_turn_reuse_one_thread_and_see_nothing_of_the_last_calls_context():
    runner = UserCode(threads=4)

    def first():
        MARK.set("left by the first call")
        return threading.get_ident()

    def second():
        return threading.get_ident(), MARK.get("unset")

    try:
        one = await runner.call(first, timeout_s=10, what="first")
        two, seen = await runner.call(second, timeout_s=10, what="second")
        assert two == one, "the second call took the idle thread, not a new one"
        assert seen == "unset"
        assert runner._workers.idle() == 1
    finally:
        runner.close()


async def test_a_thread_whose_call_was_abandoned_is_not_given_another_until_that_call_returns():
    runner, release = UserCode(threads=2), threading.Event()

    def stuck():
        release.wait(30)
        return threading.get_ident()

    try:
        with pytest.raises(UserCodeTimeout):
            await runner.call(stuck, timeout_s=0.2, what="stuck")
        abandoned = runner._workers.idle()
        other = await runner.call(threading.get_ident, timeout_s=10, what="meanwhile")
        assert abandoned == 0
        release.set()
        deadline = time.monotonic() + 10
        while runner._workers.idle() < 2 and time.monotonic() < deadline:  # the stuck call returns
            time.sleep(0.01)
        assert runner._workers.idle() == 2, "the abandoned thread came back once its call returned"
        assert len({other, *(w.thread.ident for w in runner._workers._idle)}) == 2
    finally:
        release.set()
        runner.close()


def test_idle_threads_end_after_idle_s_and_at_close(monkeypatch):
    monkeypatch.setattr(worker_threads, "IDLE_S", 0.1)
    pool, done = worker_threads.WorkerThreads(), threading.Event()
    first = pool.submit(lambda: done.set, name="a call")
    assert done.wait(10)
    first.join(10)
    assert not first.is_alive() and pool.idle() == 0, "idle past IDLE_S: ended and off the list"
    monkeypatch.setattr(worker_threads, "IDLE_S", 30.0)
    done.clear()
    second = pool.submit(lambda: done.set, name="another call")
    assert done.wait(10)
    assert pool.idle() == 1  # idle before it told its caller
    pool.close()
    second.join(10)
    assert not second.is_alive() and pool.idle() == 0


def test_a_thread_whose_hand_back_fails_serves_on():
    pool, ran = worker_threads.WorkerThreads(), threading.Event()

    def broken():
        raise RuntimeError("the caller's loop went away")

    first = pool.submit(lambda: broken, name="its caller is gone")
    deadline = time.monotonic() + 10
    while pool.idle() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.is_alive() and pool.idle() == 1
    assert pool.submit(lambda: ran.set, name="next") is first
    assert ran.wait(10)
    pool.close()


async def test_what_a_call_leaves_on_its_thread_ends_with_it():
    # An async agent's background task, left pending when its call returns, must not run during
    # (nor be named by the timeout of) a later call on the same thread.
    runner, ran = UserCode(threads=1), []

    def agent():
        async def body():
            async def background():
                await asyncio.sleep(0.05)
                ran.append("the last call's task ran on")

            asyncio.get_running_loop().create_task(background())
            return threading.get_ident()
        return call_in_thread(body)

    def later():
        async def body():
            await asyncio.sleep(0.2)
            return threading.get_ident()
        return call_in_thread(body)

    def blocking():
        time.sleep(1.0)

    try:
        first = await runner.call(agent, timeout_s=10, what="agent")
        assert await runner.call(later, timeout_s=10, what="later") == first  # the same thread
        assert ran == []
        with pytest.raises(UserCodeTimeout) as expired:
            await runner.call(blocking, timeout_s=0.3, what="blocking")
        assert expired.value.where.endswith(" in blocking"), expired.value.where
    finally:
        runner.close()


async def test_a_loop_a_call_set_and_closed_is_not_the_next_calls():
    runner = UserCode(threads=1)

    def score():  # a common sync wrapper in user libraries
        try:
            loop = asyncio.get_event_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(asyncio.sleep(0, result=1))
        finally:
            loop.close()

    try:
        assert [await runner.call(score, timeout_s=10, what="score") for _ in range(3)] == [1, 1, 1]
    finally:
        runner.close()
