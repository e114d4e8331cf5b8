"""The cheap hand-overs of the run loop (issue #32): rollout workers' ready queue
(orchestrator/run/dispatch.py), the recorder's one hand-over per loop turn, the record's blobs
packed by struct, the scorer's own slots and threads, the batched crossings to the user-code loop.
Each keeps what the slower mechanism it replaced guaranteed."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import numpy as np
import pytest

from orchestrator.run.dispatch import ReadyQueue
from orchestrator.run.recording import Recorder
from orchestrator.scoring.outcome import REWARD_TIMEOUT, ScoreFailed
from orchestrator.scoring.scorer import Scorer
from orchestrator.tasks.user_code import UserCode
from replay.log.reader import read_records
from replay.records import DiscardRecord
from replay.records.checks import FLOAT32, INT32, _as_blob


# -- the ready queue -------------------------------------------------------------------------------
async def test_the_ready_queue_hands_items_over_in_order_to_waiting_workers_then_queues_them():
    ready = ReadyQueue()
    got: list[tuple[str, int]] = []

    async def worker(name: str) -> None:
        got.append((name, await ready.take()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker, "a")
        tg.start_soon(worker, "b")
        await anyio.sleep(0.01)  # both wait
        for item in (1, 2, 3):
            ready.put(item)
    assert got == [("a", 1), ("b", 2)], "the longest waiting worker gets the first"
    assert len(ready) == 1 and await ready.take() == 3


async def test_an_item_handed_to_a_worker_cancelled_before_it_resumed_is_taken_once_or_put_back():
    ready = ReadyQueue()
    got: list[str] = []

    async def take() -> None:
        got.append(await ready.take())

    worker = asyncio.get_running_loop().create_task(take())
    await asyncio.sleep(0.01)
    ready.put("d")  # handed to the waiting worker...
    worker.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await worker
    assert got == [] and len(ready) == 1 and await ready.take() == "d", "put back, never lost"

    with anyio.CancelScope() as scope:  # anyio lets a worker whose item is handed over take it
        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await anyio.sleep(0.01)
            ready.put("e")
            scope.cancel()
    assert got + [ready._ready.popleft() for _ in range(len(ready))] == ["e"], "taken once, or put back"


# -- the recorder ----------------------------------------------------------------------------------
def _discard(i: int) -> DiscardRecord:
    return DiscardRecord(rollout_ids=[i], reason="test", step=None, at=float(i))


async def test_records_submitted_in_one_loop_turn_reach_the_writer_together_and_in_order(tmp_path):
    recorder = Recorder(tmp_path)
    for i in range(50):
        recorder.submit(_discard(i))
    assert recorder._queue.qsize() == 0, "nothing handed over before the turn ends"
    await anyio.sleep(0)
    await recorder.flush()
    assert recorder.written == 50
    for i in range(50, 60):
        recorder.submit(_discard(i))
    await recorder.flush()  # hands over what this turn submitted first
    assert recorder.written == 60
    recorder.close()
    assert [r.rollout_ids[0] for r in read_records(tmp_path)] == list(range(60))


def test_a_record_submitted_with_no_loop_running_is_handed_over_at_once(tmp_path):
    recorder = Recorder(tmp_path)
    recorder.submit(_discard(7))
    assert recorder._turn == []
    recorder.close()
    assert [r.rollout_ids for r in read_records(tmp_path)] == [[7]]


# -- the blobs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, dtype", [
    ([0, 1, -1, 2**31 - 1, -2**31, 151643], INT32),
    ((5, 6, 7), INT32),
    ([-0.5, 0.0, -0.0, 1e-30, -1e-45, float("nan"), float("-inf"), -3.4e38, 0.1, -12.345678], FLOAT32),
    ([1, 2], FLOAT32),  # ints among logprobs
    ([], INT32),
])
def test_struct_packs_the_same_bytes_as_numpy(values, dtype):
    assert _as_blob(values, dtype) == np.ascontiguousarray(values, dtype=dtype).tobytes()


def test_what_struct_refuses_goes_the_numpy_way_as_before():
    with np.errstate(over="ignore"):
        assert _as_blob([1e39], FLOAT32) == np.array([1e39]).astype(FLOAT32).tobytes()  # inf, as numpy gives
    with pytest.raises(OverflowError):
        _as_blob([2**40], INT32)  # numpy refuses it too


# -- the scorer's threads --------------------------------------------------------------------------
class _Counting:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()
        self.calls: list = []

    def score_sync(self, prompt, ids):
        with self.lock:
            self.calls.append(prompt)
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.delay_s)
        with self.lock:
            self.running -= 1
        return {"reward": float(prompt)}


async def test_a_thread_scorer_runs_at_most_workers_calls_at_once_and_answers_each_its_own():
    task = _Counting(0.002)
    scorer = Scorer(task, workers=3, timeout_s=30)
    results: dict[int, dict] = {}

    async def one(i: int) -> None:
        results[i] = await scorer.score(i, [1])

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(one, i)
    assert results == {i: {"reward": float(i)} for i in range(64)}
    assert task.most <= 3
    pool = scorer._threads
    assert pool._busy == 0 and pool._queued == 0 and pool._serving <= 3, "every slot given back"


async def test_a_call_cancelled_while_it_waits_for_a_slot_never_runs_and_holds_no_slot():
    task = _Counting(0.2)
    scorer = Scorer(task, workers=1, timeout_s=30)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scorer.score, 0, [1])
        await anyio.sleep(0.02)
        with anyio.move_on_after(0.05):
            await scorer.score(1, [1])  # waits for the one slot, then gives up
    assert await scorer.score(2, [1]) == {"reward": 2.0}
    assert task.most == 1 and scorer._threads._busy == 0 and scorer._threads._queued == 0
    assert task.calls == [0, 2], "the call given up while it waited never ran"


async def test_a_thread_scorers_timeout_is_a_reward_timeout_and_gives_the_slot_back():
    release = threading.Event()

    class Hung:
        def score_sync(self, prompt, ids):
            if prompt == "hang":
                release.wait(30)
            return {"reward": 1.0}

    scorer = Scorer(Hung(), workers=1, timeout_s=0.2)
    try:
        with pytest.raises(ScoreFailed) as err:
            await scorer.score("hang", [1])
        assert err.value.kind == REWARD_TIMEOUT
        assert await scorer.score("ok", [1]) == {"reward": 1.0}, "the slot came back; another thread serves"
    finally:
        release.set()


# -- the crossings to the user-code loop -----------------------------------------------------------
async def test_many_calls_cross_to_the_user_code_loop_together_and_each_gets_its_own_answer():
    runner = UserCode(threads=4)
    home = asyncio.get_running_loop()

    async def step(i: int):
        assert asyncio.get_running_loop() is not home
        await asyncio.sleep(0.001 * (i % 3))
        if i % 7 == 0:
            raise ValueError(f"step {i}")
        return i * 2

    outcomes: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = await runner.call(step, i, timeout_s=30, what="step")
        except ValueError as exc:
            outcomes[i] = str(exc)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, i)
    finally:
        runner.close()
    assert outcomes == {i: (f"step {i}" if i % 7 == 0 else i * 2) for i in range(200)}


async def test_a_crossing_past_its_timeout_cancels_its_task_on_the_user_code_loop():
    from orchestrator.errors import UserCodeTimeout

    runner = UserCode(threads=4)
    started, cancelled = threading.Event(), threading.Event()

    async def slow():
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(UserCodeTimeout):
            await runner.call(slow, timeout_s=1.0, what="the environment's step")
        assert started.is_set()  # (a call given up before it crossed never starts)
        with anyio.fail_after(5):
            while not cancelled.is_set():
                await anyio.sleep(0.01)
    finally:
        runner.close()
