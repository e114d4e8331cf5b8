"""Scoring completions off the event loop, bounded in time.

A task's `score_sync` (the user's reward functions included) runs in one of `task.score_workers`
worker threads (`Scorer`, `task.score_pool = "thread"`) or worker processes
(`orchestrator.scoring.pool.ScorePool`, "process"), each call bounded by `task.score_timeout_s`;
`make_scorer` builds the one configured. A call that raises or returns no finite "reward" is a
`ScoreFailed` of kind `reward_error`; one past its time is `reward_timeout` (a process is killed
and replaced; a thread is abandoned, not killed: Python cannot stop a thread, so a reward
function that never returns keeps that thread; the run goes on with fresh ones). The rollout is
then recorded `errored(<kind>)` with the message, and the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio

from orchestrator.scoring.outcome import REWARD_ERROR, REWARD_TIMEOUT, ScoreFailed, checked, one_line


class Scorer:
    def __init__(self, task, *, workers: int, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.limiter = anyio.CapacityLimiter(workers)

    async def start(self) -> None:
        """Nothing to start: threads come on demand (the same life as `ScorePool`)."""

    async def aclose(self) -> None:
        """Nothing to stop: an abandoned thread cannot be stopped."""

    async def score(self, prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        try:
            with anyio.fail_after(self.timeout_s):
                rewards = await anyio.to_thread.run_sync(self.task.score_sync, prompt, completion_token_ids,
                                                         limiter=self.limiter, abandon_on_cancel=True)
        except TimeoutError:
            raise ScoreFailed(REWARD_TIMEOUT, f"scoring took longer than task.score_timeout_s "
                                              f"({self.timeout_s:g} s)") from None
        except Exception as exc:  # noqa: BLE001 - a task's bug errors one rollout, not the run
            raise ScoreFailed(REWARD_ERROR, one_line(exc)) from None
        return checked(rewards)


def make_scorer(task, *, pool: str, workers: int, timeout_s: float, builder: Callable[[], object] | None = None,
                where: str = "task"):
    """The scorer `task.score_pool` names: "thread" scores `task` in this process's threads;
    "process" builds the task again in each of `workers` processes with `builder` (a picklable
    zero-argument callable, e.g. `functools.partial(make_task, config, model_dir, ...)`).
    Either has `start()`, `score()` and `aclose()`."""
    if pool == "thread":
        return Scorer(task, workers=workers, timeout_s=timeout_s)
    if pool == "process":
        if builder is None:
            raise ValueError("a process pool builds its task in each worker: give builder=")
        from orchestrator.scoring.pool import ScorePool

        return ScorePool(builder, workers=workers, timeout_s=timeout_s, where=where, name=f"{where}-score")
    from orchestrator.errors import ConfigError

    raise ConfigError(f"{where}.score_pool", f"must be \"process\" or \"thread\", got {pool!r}")
