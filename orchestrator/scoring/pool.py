"""Scoring in worker processes: a reward function neither takes the event loop's GIL nor, when it
hangs, a thread for ever.

`ScorePool(builder, workers=N, timeout_s=T)` starts N worker processes (each a fresh interpreter,
exec'd: never a fork of this threaded process). Each calls `builder()` once (a picklable
zero-argument callable, e.g. `functools.partial(make_task, config, model_dir, ...)`) to build its
own task, then answers one job at a time: a job is the pickled `(prompt, completion_token_ids)`,
the answer the checked scores (`scoring.checked`) or a failure. Each worker has two pipes of its
own; the event loop watches every worker's answer pipe (`loop.add_reader`, registered once per
worker) and hands each answer to the call waiting for it: no thread per call, no blocking read.

At most N calls run at once; the others wait in arrival order. A call past T seconds is a
`reward_timeout`: its worker is SIGKILLed, reaped and replaced. The replacement is a spare, built
ahead (`spare=True`, the default: one more process, started once the N are ready): a worker's
build (Python, the task's imports, its tokenizer) takes seconds, during which its slot scores
nothing, so a reward that hangs on some prompts cost its timeout plus a build each time; with the
spare it costs the timeout, and the next spare builds while the calls go on (hangs closer together
than one build still wait for one). A worker that dies mid-call is a
`reward_error` and is replaced; an exception in the task's code is a `reward_error` and the
worker is kept. A cancelled call kills its worker (its late answer must never reach the next
job); the next call on that slot starts a fresh one, as after any death.

Workers never outlive the orchestrator: each sets PR_SET_PDEATHSIG(SIGKILL) at start (Linux),
exits when its job pipe closes, and runs in a process group of its own with SIGINT ignored, so a
terminal's Ctrl-C reaches only the orchestrator, which stops gracefully and then closes the pool.
The parent-death signal fires when the *thread* that started a worker ends, so workers are
started on the event loop's thread only (in `start()` and `score()`), never from a worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import anyio

from orchestrator.errors import ConfigError, InflightError, ModelError
from orchestrator.scoring.outcome import REWARD_ERROR, REWARD_TIMEOUT, ScoreFailed, one_line
from orchestrator.scoring.worker import FRAME, READ_SIZE

START_TIMEOUT_S = 600.0  # a builder may read a dataset and load a tokenizer
STOP_GRACE_S = 2.0  # an idle worker exits on its job pipe's EOF within this
KILL_WAIT_S = 5.0  # SIGKILL is never refused: this only bounds a slow reap
# Workers yield the CPU to the event loop (and to the engines' and trainer's processes) when the
# machine is short of it: a woken worker then does not preempt the loop on its core. Measured on
# 2 busy cores with a 1 ms reward: rollouts/s x1.4-1.7 against nice 0; with cores to spare it
# changes nothing.
NICE = 5
_TIMEOUT, _DIED, _CLOSED = object(), object(), object()
_WORKER_CODE = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                "from orchestrator.scoring.worker import worker_main; worker_main(*sys.argv[2:])")


class _Worker:
    """One worker process, the parent's ends of its pipes, and what came back on them."""

    def __init__(self, process: subprocess.Popen, job_fd: int, answer_fd: int, loop) -> None:
        self.process, self.job_fd, self.answer_fd, self.loop = process, job_fd, answer_fd, loop
        self.pending: asyncio.Future | None = None  # the one call waiting for its next message
        self.unread: collections.deque[bytes] = collections.deque()  # came with no one waiting
        self.buffer = bytearray()
        self.eof = self.closed = self.ready = False
        os.set_blocking(answer_fd, False)
        os.set_blocking(job_fd, False)  # a message larger than the pipe never blocks the loop
        loop.add_reader(answer_fd, self._readable)

    @property
    def busy(self) -> bool:
        return self.pending is not None

    async def send(self, payload: bytes, timeout_s: float):
        """One message; None once written, or _DIED (the worker is gone), _TIMEOUT (it did not
        read it in time), _CLOSED (closed meanwhile). One write, no wait, unless it is larger than
        the pipe holds."""
        data = memoryview(FRAME.pack(len(payload)) + payload)
        deadline = None
        while data:
            try:
                data = data[os.write(self.job_fd, data):]
            except BlockingIOError:
                deadline = deadline or self.loop.time() + timeout_s
                with anyio.move_on_after(deadline - self.loop.time()):
                    try:
                        await anyio.wait_writable(self.job_fd)
                    except anyio.ClosedResourceError:  # closed meanwhile (see close)
                        return _CLOSED
                    continue
                return _TIMEOUT
            except OSError:
                return _DIED
        return None

    def _readable(self) -> None:
        try:
            data = os.read(self.answer_fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
            self.loop.remove_reader(self.answer_fd)
            self._deliver(_DIED)
            return
        self.buffer += data
        while len(self.buffer) >= FRAME.size:
            size = FRAME.unpack_from(self.buffer)[0]
            if len(self.buffer) < FRAME.size + size:
                return
            message = bytes(self.buffer[FRAME.size:FRAME.size + size])
            del self.buffer[:FRAME.size + size]
            self._deliver(message)

    def _deliver(self, message) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.set_result(message)
        elif message is not _DIED:
            self.unread.append(message)

    async def next_message(self, timeout_s: float):
        """The next message: bytes, or _TIMEOUT, _DIED (EOF: the process ended), _CLOSED."""
        if self.unread:
            return self.unread.popleft()
        if self.eof:
            return _DIED
        if self.closed:
            return _CLOSED
        fut = self.pending = self.loop.create_future()
        timer = self.loop.call_at(self.loop.time() + timeout_s, _expire, fut)
        try:
            return await fut
        finally:
            timer.cancel()
            self.pending = None

    def close(self) -> None:
        """Stop watching and close the parent's ends (a call waiting wakes with _CLOSED)."""
        if self.closed:
            return
        self.closed = True
        if not self.eof:
            self.loop.remove_reader(self.answer_fd)
        # A send still waiting to write (another task's) wakes (_CLOSED) before the number can
        # name another pipe.
        anyio.notify_closing(self.job_fd)
        os.close(self.job_fd)
        os.close(self.answer_fd)
        self._deliver(_CLOSED)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(_TIMEOUT)


class ScorePool:
    def __init__(self, builder: Callable[[], object], *, workers: int, timeout_s: float, name: str = "score",
                 where: str = "task", start_timeout_s: float = START_TIMEOUT_S, nice: int = NICE,
                 spare: bool = True) -> None:
        """`where`: the config section a builder's unnamed failure is reported under; `nice`:
        the workers' CPU niceness (see NICE); `spare`: keep one more worker built, to replace a
        killed or dead one at once."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.builder, self.workers, self.timeout_s = builder, workers, timeout_s
        self.name, self.where, self.start_timeout_s, self.nice = name, where, start_timeout_s, nice
        self._builder_bytes = b""
        self._loop = None
        self._slots: list[_Worker | None] = [None] * workers
        self._idle = list(range(workers))  # slots free for a call: one per unit of the semaphore
        # FIFO: waiting calls are served in arrival order; no extra loop pass when one is free.
        self._limit = anyio.Semaphore(workers, fast_acquire=True)
        self._dead: list[subprocess.Popen] = []  # killed, reaped later
        self.spare = spare
        self._spare: _Worker | None = None  # built (or building) ahead, in no slot yet
        self._ready = self._closed = False

    # -- life --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker and wait until each has built its task. A builder's ConfigError
        (or another InflightError) is re-raised as it was; anything else becomes
        ConfigError(where, one line). Nothing is left running after a failure."""
        if self._ready or self._closed:
            return
        self._loop = asyncio.get_running_loop()
        try:
            self._builder_bytes = pickle.dumps(self.builder, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - a lambda or closure: say what cannot travel
            raise ConfigError(self.where, f"the task cannot be sent to a scoring process: {one_line(exc)}") from None
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for slot in range(self.workers):
                await self._spawn(slot, deadline)
            for worker in self._slots:
                await self._handshake(worker, deadline)
            await self._spare_again()  # builds while the run starts; not waited for
        except BaseException:
            await self.aclose()
            raise
        self._ready = True

    async def aclose(self) -> None:
        """Stop every worker: an idle one exits when its job pipe closes, a busy one (or one
        past a grace) gets SIGTERM, then SIGKILL; every process is reaped. A call still waiting
        fails. Shielded and bounded; idempotent."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            workers = [w for w in [*self._slots, self._spare] if w is not None]
            self._slots, self._spare = [None] * self.workers, None
            processes = [w.process for w in workers] + self._dead
            self._dead = []
            for worker in workers:
                if worker.busy and worker.process.poll() is None:
                    worker.process.terminate()
                worker.close()
            await _wait_exited(processes, STOP_GRACE_S)
            _signal_running(processes, signal.SIGTERM)
            await _wait_exited(processes, 1.0)
            _signal_running(processes, signal.SIGKILL)
            await _wait_exited(processes, KILL_WAIT_S)

    @property
    def pids(self) -> list[int]:
        """The worker processes now started (diagnostics and tests)."""
        return [w.process.pid for w in self._slots if w is not None]

    @property
    def spare_pid(self) -> int | None:
        """The spare's process, built or building (None: none now)."""
        return None if self._spare is None else self._spare.process.pid

    @property
    def spare_answered(self) -> bool:
        """Whether the spare has said how its build went (its "ready", or its failure)."""
        return self._spare is not None and bool(self._spare.unread) and not self._spare.eof

    # -- calls -------------------------------------------------------------------------------------
    async def score(self, prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        """The task's `score_sync(prompt, completion_token_ids)` in a worker; the same contract
        and errors as `orchestrator.scoring.scorer.Scorer.score`."""
        if not self._ready or self._closed:
            raise ScoreFailed(REWARD_ERROR, "the scoring pool is " + ("closed" if self._closed else "not started"))
        try:
            job = pickle.dumps((prompt, list(completion_token_ids)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - e.g. a row holding an open file
            raise ScoreFailed(REWARD_ERROR, "the prompt cannot be sent to a scoring process: "
                                            + one_line(exc)) from None
        async with self._limit:
            slot = self._idle.pop()
            try:
                return await self._call(slot, job)
            finally:
                self._idle.append(slot)

    async def _call(self, slot: int, job: bytes) -> dict[str, float]:
        worker = await self._worker_for(slot)
        try:
            answer = await worker.send(job, self.timeout_s) or await worker.next_message(self.timeout_s)
        except BaseException:  # cancelled: its answer may still come, and must not meet the next job
            self._kill_now(slot, worker)
            raise
        if answer is _TIMEOUT:
            await self._discard(slot, worker)
            raise ScoreFailed(REWARD_TIMEOUT, f"scoring took longer than task.score_timeout_s "
                                              f"({self.timeout_s:g} s); its process was killed")
        if answer is _DIED or answer is _CLOSED:
            code = await self._discard(slot, worker)
            raise ScoreFailed(REWARD_ERROR, "the scoring pool was closed during the call" if answer is _CLOSED
                              else f"the scoring worker died (exit code {_code_text(code)})")
        reply = pickle.loads(answer)
        if reply[0] == "ok":
            return reply[1]
        raise ScoreFailed(reply[1], reply[2])

    async def _worker_for(self, slot: int) -> _Worker:
        """The slot's worker, ready: a fresh one when it was killed or died while idle."""
        if self._dead:
            self._dead = [p for p in self._dead if p.poll() is None]  # reap what was killed meanwhile
        if self._spare is not None and self._spare.eof:  # it died idle (its build failed, a kill): another
            self._kill_now(None, self._spare)
            await self._spare_again()
        worker = self._slots[slot]
        # EOF on its watched pipe: it died between calls (the OOM killer, a kill from outside).
        # Not ready: its start was cancelled half-way.
        if worker is not None and (worker.eof or not worker.ready):
            await self._discard(slot, worker)
            worker = None
        if worker is None:
            if self._closed:  # closed while this call waited for a slot: start nothing more
                raise ScoreFailed(REWARD_ERROR, "the scoring pool is closed")
            deadline = time.monotonic() + self.start_timeout_s
            try:
                worker = self._take_spare(slot) or await self._spawn(slot, deadline)
                await self._spare_again()  # the next one builds while this one finishes
                await self._handshake(worker, deadline)
            except BaseException as exc:
                if self._slots[slot] is not None:
                    self._kill_now(slot, self._slots[slot])
                if isinstance(exc, Exception):  # the builder failed this time, or no process could start
                    raise ScoreFailed(REWARD_ERROR, f"a scoring process could not restart: {one_line(exc)}") from None
                raise
        return worker

    def _take_spare(self, slot: int) -> _Worker | None:
        """The spare, into `slot`; None when there is none or it died while it waited (a fresh
        worker is then built, as without a spare: a builder that now fails says so there)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if spare.eof or spare.process.poll() is not None:
            self._kill_now(None, spare)
            return None
        self._slots[slot] = spare
        return spare

    async def _spare_again(self) -> None:
        """Start building the next spare (its answer is read when it is taken). One that cannot
        start leaves no spare: replacements are then built when needed, as without one."""
        if not self.spare or self._spare is not None or self._closed:
            return
        try:
            await self._spawn(None, time.monotonic() + self.start_timeout_s)
        except Exception:  # noqa: BLE001 - e.g. no process could start: the call goes on without it
            if self._spare is not None:
                self._kill_now(None, self._spare)

    # -- processes ---------------------------------------------------------------------------------
    async def _spawn(self, slot: int | None, deadline: float) -> _Worker:
        """A fresh worker in `slot` (None: the spare), its builder sent. On the event loop's
        thread: the worker's parent-death signal is tied to the thread that started it."""
        job_r, job_w = os.pipe()
        answer_r, answer_w = os.pipe()
        path = json.dumps([str(p) for p in sys.path])  # the builder's modules import as they do here
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, path, str(job_r), str(answer_w), str(os.getpid()),
                 f"{self.name}-{'s' if slot is None else slot}", str(self.nice)],
                pass_fds=(job_r, answer_w), stdin=subprocess.DEVNULL,
                process_group=0)  # a terminal's Ctrl-C goes to the orchestrator's group only
        except BaseException:
            os.close(job_w)
            os.close(answer_r)
            raise
        finally:
            os.close(job_r)
            os.close(answer_w)
        try:
            worker = _Worker(process, job_w, answer_r, self._loop)
        except BaseException:
            process.kill()
            self._dead.append(process)
            os.close(job_w)
            os.close(answer_r)
            raise
        if slot is None:  # aclose() sees it at once, wherever it is
            self._spare = worker
        else:
            self._slots[slot] = worker
        try:
            # Not sent (it died at once, or never read): the handshake says so, with its exit code.
            await worker.send(self._builder_bytes, max(0.0, deadline - time.monotonic()))
        except BaseException:  # cancelled with part of its builder sent: it would wait for the rest
            self._kill_now(slot, worker)
            raise
        return worker

    async def _handshake(self, worker: _Worker, deadline: float) -> None:
        """Wait for the worker's "ready"; its builder's error is raised here."""
        answer = await worker.next_message(max(0.0, deadline - time.monotonic()))
        if answer is _TIMEOUT:
            raise ConfigError(self.where, f"the scoring processes did not build the task within "
                                          f"{self.start_timeout_s:g} s")
        if answer is _DIED or answer is _CLOSED:
            code = await _exit_code(worker.process)
            raise ConfigError(self.where, f"a scoring process died while building the task "
                                          f"(exit code {_code_text(code)})")
        reply = pickle.loads(answer)
        if reply[0] != "ready":
            raise _start_error(reply[1], self.where)
        worker.ready = True

    async def _discard(self, slot: int, worker: _Worker) -> int | None:
        """Kill the slot's worker if it still runs, reap it (bounded), free the slot; its
        exit code (None if it could not be reaped in time)."""
        self._kill_now(slot, worker)
        return await _exit_code(worker.process)

    def _kill_now(self, slot: int | None, worker: _Worker) -> None:
        """SIGKILL without waiting (safe under cancellation); reaped later. `slot` None: the spare."""
        if slot is None:
            if self._spare is worker:
                self._spare = None
        elif self._slots[slot] is worker:
            self._slots[slot] = None
        if worker.process.poll() is None:
            worker.process.kill()
            self._dead.append(worker.process)
        worker.close()


def _start_error(encoded: tuple, where: str) -> InflightError:
    kind = encoded[0]
    if kind == "config":
        return ConfigError(encoded[1], encoded[2])
    if kind == "model":
        return ModelError(encoded[1], encoded[2])
    if kind == "pickled":
        return pickle.loads(encoded[1])
    return ConfigError(where, encoded[1])


# -- small helpers -----------------------------------------------------------------------------------
async def _exit_code(process: subprocess.Popen, wait_s: float = KILL_WAIT_S) -> int | None:
    await _wait_exited([process], wait_s)
    return process.poll()


async def _wait_exited(processes: list[subprocess.Popen], wait_s: float) -> None:
    """Poll until every process is reaped or `wait_s` passed (no thread, no blocking wait)."""
    deadline = time.monotonic() + wait_s
    delay = 0.001
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        await anyio.sleep(delay)
        delay = min(delay * 2, 0.05)


def _signal_running(processes: list[subprocess.Popen], sig: int) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(sig)


def _code_text(code: int | None) -> str:
    if code is None:
        return "unknown: not reaped in time"
    if code < 0:
        try:
            return f"{code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return str(code)
