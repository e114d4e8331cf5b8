"""Where the user's code runs: every call into it from the run goes through `UserCode.call`.

    result = await user_code.call(fn, *args, timeout_s=30.0, what="tool 'add'")

- A plain `def` runs in a worker thread (kept between calls: `worker_threads`), never on an
  event loop. One limiter per run bounds the threads running calls at once: `threads`, sized by
  the run from `scheduler.max_inflight`. A rollout makes one call at a time (an agent holds one
  for its whole episode; an environment's plain reset or step, a tool, a score one each), so no
  rollout waits for a thread behind the others.
- An `async def` runs on the user-code loop: one thread with its own asyncio loop, never the
  run's. Only async code runs there, never a plain `def` (a tool or a score that an environment's
  step calls goes to a worker thread like any other), so a blocking function cannot stall the
  episodes whose steps interleave there. `here=True` (an environment that declares `on_loop =
  True`) awaits an async function on the caller's loop instead: no hop.
- Each call is bounded by `timeout_s`, counted from when it starts to run: a wait for a thread is
  not counted (with the pool full, the calls queued behind it would time out before they began).
  Past it the caller gets `UserCodeTimeout(what, timeout_s)`: an async call is cancelled on its
  loop; a thread cannot be stopped, so it is abandoned, never joined. Its slot is given back at
  once, so abandoned threads never hold the pool (the threads alive may exceed `threads` by the
  abandoned ones still running); each is a daemon thread, so one that never returns does not hold
  the process at its exit either.
- Code running inside a call finds its runner with `current()`. A call made from the user-code
  loop (a step calling its tools) is performed from the loop the outer call came from, so the
  run's one limiter bounds it too; when the outer call runs past its time during it, the error
  names both ("the environment's step (in tool 'add')").

`call_in_thread(fn, ...)` is the other half, for code that is already in a worker thread (a
scoring thread or process, an agent's thread): fn, and an awaitable it returns run to the end on
that thread's own event loop (one per thread, reused, closed when the thread ends; on this
runner's worker threads, closed at the end of each call: `end_thread_loop`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from orchestrator.errors import UserCodeTimeout
from orchestrator.tasks.worker_threads import WorkerThreads

# A run's default when it does not say (scheduler.max_inflight's default).
DEFAULT_THREADS = 256


@dataclass
class _Call:
    """One call in progress on the user-code loop: what it is, and the call it made, if any."""

    runner: UserCode
    what: str
    inner: str | None = None
    thread: threading.Thread | None = None  # the worker thread running it, if any

    def named(self) -> str:
        return self.what if self.inner is None else f"{self.what} (in {self.inner})"


_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("inflight_user_call")


class UserCode:
    """The runner of one run's calls into user code (see the module's docstring)."""

    def __init__(self, threads: int = DEFAULT_THREADS, *, name: str = "user-code") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        self.name = name
        # One limiter per event loop that calls (a run has one; tests run many loops in turn).
        self._limiters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._home: asyncio.AbstractEventLoop | None = None  # where calls from the user-code loop go
        self._loop: asyncio.AbstractEventLoop | None = None  # the user-code loop, started on first use
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hops: _Hops | None = None  # the crossings between the run's loop and the user-code loop
        self._workers = WorkerThreads(after_call=end_thread_loop)  # plain defs' threads, kept between calls

    async def call(self, fn: Callable, *args, timeout_s: float, what: str, here: bool = False):
        """`fn(*args)`, awaited when async, where its kind runs; UserCodeTimeout past `timeout_s`."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return await self._from_user_loop(fn, args, timeout_s, what)
        self._home = loop
        call = _Call(self, what)
        if is_async(fn):
            if not here:  # to the user-code loop, bounded by a timer of the hop's own
                return await self._on_user_loop(lambda: fn(*args), call, timeout_s)
            return await self._timed(call, timeout_s, self._run_here(fn, args, call))
        async with self._limiter(loop):  # the wait for a thread is not the call's time
            return await self._timed(call, timeout_s, self._run_in_thread(fn, args, call))

    def busy(self) -> int:
        """Threads this runner counts as running calls now (abandoned ones are not)."""
        return sum(int(limiter.borrowed_tokens) for limiter in list(self._limiters.values()))

    def close(self) -> None:
        """Stop the user-code loop (a later async call starts another) and the idle worker threads."""
        self._workers.close()
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(5.0)

    # -- where a call runs ----------------------------------------------------------------------
    async def _timed(self, call: _Call, timeout_s: float, running):
        # move_on_after, not fail_after: a TimeoutError the user's code raises itself is its own.
        with anyio.move_on_after(timeout_s):
            return await running
        raise UserCodeTimeout(call.named(), timeout_s, where=where_is(call.thread))

    async def _run_here(self, fn, args, call: _Call):
        token = _CALL.set(call)  # code it calls (a tool) finds this runner
        try:
            return await fn(*args)
        finally:
            _CALL.reset(token)

    async def _run_in_thread(self, fn, args, call: _Call):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        call.thread = self._workers.submit(functools.partial(_work, loop, done, fn, args),
                                           name=f"{self.name}: {call.what}"[:80])
        result = await done  # cancelled (a timeout, the run's cancellation): the thread is abandoned
        if inspect.isawaitable(result):  # a plain def that returned a coroutine: the rest runs as async code
            result = await self._on_user_loop(lambda: result, call)
        return result

    async def _on_user_loop(self, make: Callable, call: _Call, timeout_s: float | None = None):
        home = asyncio.get_running_loop()
        hops = self._hops_from(home)
        hop = hops.send(make, call)
        # A timer rather than a cancel scope (an environment's turn makes one or two of these on
        # the run's loop): past `timeout_s` the hop's future gets the timeout, and the except
        # below cancels its task on the user-code loop.
        timer = None if timeout_s is None else home.call_later(timeout_s, _expire, hop, timeout_s)
        try:
            return await hop.future
        except BaseException:
            hops.cancel(hop)  # cancels the task on the user-code loop
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _hops_from(self, home: asyncio.AbstractEventLoop) -> _Hops:
        user = self._user_loop()
        hops = self._hops
        if hops is None or hops.home is not home or hops.user is not user:
            hops = self._hops = _Hops(home, user)
        return hops

    async def _from_user_loop(self, fn, args, timeout_s: float, what: str):
        """A call that async user code makes (a step calling a tool): performed from the loop of
        the call it runs in, under that loop's limiter."""
        home = self._home
        if home is None or home.is_closed():
            raise RuntimeError(f"{what}: called on the user-code loop with no run's loop to perform it")
        outer = _CALL.get(None)
        if outer is not None:
            outer.inner = what
        future = asyncio.run_coroutine_threadsafe(self.call(fn, *args, timeout_s=timeout_s, what=what), home)
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The outer call is cancelled (its timeout, say) while this one runs: `inner` stays
            # set, so that the outer call's error, raised on the other loop, names this one.
            future.cancel()
            raise
        except BaseException:
            future.cancel()
            _done_inside(outer)
            raise
        _done_inside(outer)
        return result

    def _limiter(self, loop: asyncio.AbstractEventLoop) -> anyio.CapacityLimiter:
        limiter = self._limiters.get(loop)
        if limiter is None:
            limiter = self._limiters[loop] = anyio.CapacityLimiter(self.threads)
        return limiter

    def _user_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=_serve, args=(loop,), name=f"{self.name} loop", daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop


@dataclass(eq=False)
class _Hop:
    """One call crossing to the user-code loop: its outcome settles `future` on the caller's."""

    make: Callable
    call: _Call
    future: asyncio.Future
    task: asyncio.Task | None = None  # on the user-code loop, once started
    cancelled: bool = False  # the caller gave up before it started: never started


class _Hops:
    """Calls from one loop (the run's) to the user-code loop, and their outcomes back. Those made
    during one turn of a loop cross together: one wake-up of the other loop (a write to its
    self-pipe, then a hand-over of the GIL) for all of them, not one each way per call, and no
    concurrent.futures.Future (a Condition) per call. On the zero-latency engine of `inflight
    bench orchestrator` a 4-turn episode makes five crossings (reset, four steps); one cost the
    run's loop about 55 us of CPU through run_coroutine_threadsafe and wrap_future."""

    def __init__(self, home: asyncio.AbstractEventLoop, user: asyncio.AbstractEventLoop) -> None:
        self.home, self.user = home, user
        self._out: list[_Hop] = []  # made during this turn of the home loop, not yet sent
        self._back: list[tuple[_Hop, tuple]] = []  # outcomes not yet settled on the home loop
        self._back_lock = threading.Lock()

    # -- on the home loop ------------------------------------------------------------------------
    def send(self, make: Callable, call: _Call) -> _Hop:
        hop = _Hop(make, call, self.home.create_future())
        self._out.append(hop)
        if len(self._out) == 1:
            self.home.call_soon(self._flush)  # at the end of this turn
        return hop

    def cancel(self, hop: _Hop) -> None:
        hop.cancelled = True
        try:
            self.user.call_soon_threadsafe(_cancel_task, hop)
        except RuntimeError:  # the user-code loop is closed: nothing runs there any more
            pass

    def _flush(self) -> None:
        out, self._out = self._out, []
        try:
            self.user.call_soon_threadsafe(self._start, out)
        except RuntimeError as exc:  # closed (as run_coroutine_threadsafe raised)
            for hop in out:
                if not hop.future.done():
                    hop.future.set_exception(RuntimeError(f"the user-code loop is closed: {exc}"))

    def _settle_back(self) -> None:
        with self._back_lock:
            back, self._back = self._back, []
        for hop, (result, error) in back:
            if hop.future.done():  # the caller gave up (its timeout, its cancellation)
                if inspect.iscoroutine(result):
                    result.close()
            elif error is not None:
                hop.future.set_exception(error)
            else:
                hop.future.set_result(result)

    # -- on the user-code loop -------------------------------------------------------------------
    def _start(self, hops: list[_Hop]) -> None:
        for hop in hops:
            if hop.cancelled:
                continue
            hop.task = self.user.create_task(_invoke(hop.make, hop.call))
            hop.task.add_done_callback(functools.partial(self._finished, hop))

    def _finished(self, hop: _Hop, task: asyncio.Task) -> None:
        if task.cancelled():
            outcome = (None, asyncio.CancelledError())
        else:
            error = task.exception()
            outcome = (None, error) if error is not None else (task.result(), None)
        with self._back_lock:
            self._back.append((hop, outcome))
            first = len(self._back) == 1
        if first:
            try:
                self.home.call_soon_threadsafe(self._settle_back)
            except RuntimeError:  # the run's loop is closed: nobody waits for these any more
                with self._back_lock:
                    self._back.clear()


def _expire(hop: _Hop, timeout_s: float) -> None:
    if not hop.future.done():
        hop.future.set_exception(UserCodeTimeout(hop.call.named(), timeout_s, where=where_is(hop.call.thread)))


def _cancel_task(hop: _Hop) -> None:
    if hop.task is not None:
        hop.task.cancel()


def _done_inside(outer: _Call | None) -> None:
    if outer is not None:
        outer.inner = None


def current() -> UserCode:
    """The runner of the call this code runs in (a tool called from an environment's step is
    run by the step's runner); outside any call, the process's default."""
    call = _CALL.get(None)
    return call.runner if call is not None else _default()


_DEFAULT: list[UserCode] = []


def _default() -> UserCode:
    if not _DEFAULT:
        _DEFAULT.append(UserCode(name="user-code (default)"))
    return _DEFAULT[0]


def is_async(fn) -> bool:
    """Whether calling `fn` gives a coroutine: an `async def`, a partial of one, or an object
    whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


async def _invoke(make: Callable, call: _Call):
    _CALL.set(call)  # this task's own context: code it calls (a tool) finds its runner and call
    return await make()


def _work(loop: asyncio.AbstractEventLoop, done: asyncio.Future, fn, args) -> Callable[[], None]:
    """A worker thread's call: fn(*args); returns what hands its outcome to the waiting loop."""
    try:
        result, error = fn(*args), None
    except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
        result, error = None, exc
    return functools.partial(_hand_back, loop, done, result, error)


def _hand_back(loop: asyncio.AbstractEventLoop, done: asyncio.Future, result, error: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_settle, done, result, error)
    except RuntimeError:  # the loop is closed: nobody waits for an abandoned call
        if inspect.iscoroutine(result):
            result.close()


def _settle(done: asyncio.Future, result, error: BaseException | None) -> None:
    if done.done():  # the caller gave up (its timeout, its cancellation)
        if inspect.iscoroutine(result):
            result.close()
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


# -- from a worker thread ----------------------------------------------------------------------------

class _ThreadLoop(threading.local):
    loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> asyncio.AbstractEventLoop:
        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
            self._closer = _LoopCloser(self.loop)
            _LOOP_OF_THREAD[threading.get_ident()] = self.loop
        return self.loop


class _LoopCloser:
    # Lives in the thread's local storage: when the thread ends, it is dropped and closes the loop.
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __del__(self) -> None:
        if not self.loop.is_running():
            self.loop.close()


_thread_loop = _ThreadLoop()
THREAD_LOOP_CLOSE_S = 1.0  # how long a call's leftover tasks get to finish once cancelled


def end_thread_loop() -> None:
    """On a worker thread after a call into user code: what the call left on the thread ends with
    it, as it did when each call had a thread of its own: its event loop (tasks still pending are
    cancelled and get `THREAD_LOOP_CLOSE_S` to finish, async generators are closed) and the
    thread's current-loop setting (`asyncio.set_event_loop`). The next call starts clean."""
    loop, _thread_loop.loop = _thread_loop.loop, None
    try:
        if loop is not None and not loop.is_closed() and not loop.is_running():
            try:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.wait(pending, timeout=THREAD_LOOP_CLOSE_S))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
    finally:
        asyncio.set_event_loop(None)
# Each worker thread's own loop, by thread id (weakly: gone with the loop), so that a call that
# runs past its time can say where its async code waits (`where_is`).
_LOOP_OF_THREAD: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# Frames of this package's plumbing and of asyncio's: never where the user's code is.
_PLUMBING = (os.sep + "asyncio" + os.sep, os.path.join("orchestrator", "tasks", "user_code.py"),
             os.path.join("orchestrator", "tasks", "worker_threads.py"), os.path.join("orchestrator", "tasks", "agent.py"),
             os.sep + "selectors.py", os.sep + "threading.py")


def where_is(thread: threading.Thread | None, frames: int = 3) -> str | None:
    """Where `thread` is now: its innermost `frames` frames ("httpx/_client.py:12 in send <- ..."),
    then its outermost one (the user's function) when not among them. For a thread that runs an
    event loop of its own (an async agent), where its tasks wait. None when not known."""
    if thread is None or thread.ident is None:
        return None
    try:
        stacks = []
        loop = _LOOP_OF_THREAD.get(thread.ident)
        if loop is not None and not loop.is_closed():
            # Read from another thread, for a message only: a task set that changes meanwhile
            # raises RuntimeError, and the place is then not known (None).
            for task in list(asyncio.all_tasks(loop)):
                stacks.append(list(_awaiting(task.get_coro())))
        frame = sys._current_frames().get(thread.ident)
        if frame is not None:
            stacks.append(list(reversed(list(_outward(frame)))))
        for stack in stacks:
            named = [f for f in reversed(stack) if not any(p in f.f_code.co_filename for p in _PLUMBING)]
            if named:
                shown = named[:frames] + ([named[-1]] if len(named) > frames else [])
                return " <- ".join(_frame_name(f) for f in shown)
    except RuntimeError:  # the thread's task set changed while read: not known this time
        return None
    return None


def _awaiting(coro):
    """The frames of a suspended coroutine and of those it awaits, outermost first."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            yield frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)


def _outward(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _frame_name(frame) -> str:
    path = frame.f_code.co_filename
    short = os.sep.join(path.split(os.sep)[-2:])
    return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"


def refuse_running_loop(what: str) -> None:
    """RuntimeError when an event loop runs in this thread: `what` blocks, call it in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{what} blocks until its async code is done: call it in a worker thread, "
                       "not on an event loop")


def call_in_thread(fn: Callable, *args, **kwargs):
    """From a worker thread: `fn(*args, **kwargs)`; an awaitable it returns runs to its end on
    this thread's own event loop (one per thread, reused), never on the run's."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        try:
            refuse_running_loop(getattr(fn, "__qualname__", "this call"))
        except RuntimeError:
            if inspect.iscoroutine(result):
                result.close()
            raise
        result = _thread_loop.get().run_until_complete(_await(result))
    return result


async def _await(awaitable):
    return await awaitable
