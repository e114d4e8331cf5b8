"""Held-out evaluation: k samples of each eval prompt at one version, mean@k and pass@k.

During `inflight run` (`[eval] every_steps`) the loop runs an evaluation on the live fleet while
the trainer keeps stepping; activations wait until it ends (`RunLoop.activation_lock`), so every
evaluated token carries the version the record names. `inflight eval` runs the same evaluation
standalone on a run's version or a model directory. Eval rollouts are never consumed.

    mean@k  the mean reward over every scored sample
    pass@k  the share of prompts with at least one sample whose reward >= pass_threshold
A sample that ends without a score (an engine or reward error) is counted in `errored` and left
out of both: nothing is invented for it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import msgspec

from orchestrator.observe.logging import get_logger
from orchestrator.scoring.outcome import ScoreFailed

log = get_logger(__name__)


class Sample(msgspec.Struct, frozen=True):
    prompt: int  # index into the evaluation's prompts
    rewards: dict[str, float] | None  # None: it ended without a score
    completion_tokens: int


def summarize(samples_per_prompt: Sequence[Sequence[Sample]], threshold: float
              ) -> tuple[float | None, float | None, dict[str, float]]:
    """(mean@k, pass@k, mean of each reward component) over the scored samples."""
    scored = [s.rewards for group in samples_per_prompt for s in group if s.rewards is not None]
    mean = sum(r["reward"] for r in scored) / len(scored) if scored else None
    judged = [group for group in samples_per_prompt if any(s.rewards is not None for s in group)]
    passed = sum(any(s.rewards is not None and s.rewards["reward"] >= threshold for s in group) for group in judged)
    pass_at_k = passed / len(judged) if judged else None
    components: dict[str, list[float]] = {}
    for r in scored:
        for name, value in r.items():
            if name != "reward":
                components.setdefault(name, []).append(value)
    return mean, pass_at_k, {name: sum(v) / len(v) for name, v in components.items()}


class Evaluator:
    """Evaluates one task's first prompts (built once) with its own scorer."""

    def __init__(self, task, scorer, config, sampling) -> None:
        if getattr(task, "episodic", False):
            from orchestrator.errors import ConfigError

            raise ConfigError("eval", "held-out evaluation of a multi-turn task is not built yet: set "
                                      "eval.every_steps = 0, or give [eval] a single-turn dataset or task")
        self.task = task
        self.scorer = scorer
        self.config = config  # orchestrator.config.run.EvalConfig
        changes = {"max_tokens": config.max_tokens} if config.max_tokens is not None else {}
        if config.temperature is not None:
            changes["temperature"] = config.temperature
        self.sampling = msgspec.structs.replace(sampling, **changes)
        self.prompts: list = []
        self.rounds = 0

    @property
    def name(self) -> str:
        return self.task.name

    async def load(self) -> None:
        rows = self.task.rows
        count = self.config.max_prompts if rows is None else min(rows, self.config.max_prompts)
        self.prompts = [await self.task.prompt(i) for i in range(count)]

    async def run(self, fleet, *, step: int, version: int, concurrency: int = 64):
        """One evaluation on `fleet`, whose live version must stay `version` throughout."""
        from replay.records import EvalPrompt, EvalRecord

        started, self.rounds = time.monotonic(), self.rounds + 1
        k = self.config.samples_per_prompt
        samples: list[list[Sample]] = [[] for _ in self.prompts]
        limiter = anyio.CapacityLimiter(concurrency)

        async def one(p: int, j: int) -> None:
            async with limiter:
                samples[p].append(await self._sample(fleet, p, j, version))

        async with anyio.create_task_group() as tg:
            for p in range(len(self.prompts)):
                for j in range(k):
                    tg.start_soon(one, p, j)
        mean, pass_at_k, components = summarize(samples, self.config.pass_threshold)
        results = [EvalPrompt(prompt_id=self.prompts[p].prompt_id,
                              rewards=[s.rewards["reward"] for s in group if s.rewards is not None],
                              completion_tokens=[s.completion_tokens for s in group if s.rewards is not None],
                              errored=sum(s.rewards is None for s in group))
                   for p, group in enumerate(samples)]
        return EvalRecord(step=step, version=version, task=self.name, k=k, prompts=len(self.prompts),
                          mean_at_k=mean, pass_at_k=pass_at_k, pass_threshold=self.config.pass_threshold,
                          results=results, components=components, at=time.time(),
                          seconds=time.monotonic() - started)

    async def _sample(self, fleet, p: int, j: int, version: int) -> Sample:
        from orchestrator.errors import ActivationError, EngineError

        prompt = self.prompts[p]
        try:
            completion = await fleet.generate(prompt.token_ids, self.sampling,
                                              request_id=f"eval-{self.rounds}-{p}-{j}", redispatch=False,
                                              final_only=True)
        except (EngineError, ActivationError) as exc:
            log.warning("eval.sample_failed", prompt=prompt.prompt_id, error=str(exc))
            return Sample(p, None, 0)
        tokens = len(completion.token_ids)
        if completion.status != "completed":
            log.warning("eval.sample_failed", prompt=prompt.prompt_id, status=completion.status,
                        reason=completion.reason)
            return Sample(p, None, tokens)
        versions = {v for _, v in completion.changes} or {completion.dispatched_version}
        if versions != {version}:  # activations wait for an evaluation: this would be a bug
            log.error("eval.version_mixed", prompt=prompt.prompt_id, versions=sorted(versions), expected=version)
            return Sample(p, None, tokens)
        try:
            rewards = await self.scorer.score(prompt, completion.token_ids)
        except ScoreFailed as exc:
            log.warning("eval.score_failed", prompt=prompt.prompt_id, kind=exc.kind, error=exc.message)
            return Sample(p, None, tokens)
        return Sample(p, rewards, tokens)


async def run_evaluations(loop) -> None:
    """The run loop's evaluation task (`orchestrator.run.loop.RunLoop`): a held-out evaluation before
    the first step (eval.at_start) and whenever the live version reaches a multiple of
    eval.every_steps (activations may skip versions: the first live version at or past the
    multiple is evaluated)."""
    evaluator, fleet = loop.run.evaluator, loop.run.fleet
    every = loop.run.config.eval.every_steps
    last_round = fleet.live_version // every  # evaluated (or not due) up to here
    if loop.run.config.eval.at_start and fleet.live_version == 0 and loop.run.scheduler.done_steps == 0:
        last_round = -1
        loop.eval_wanted.set()
    while True:
        await loop.eval_wanted.wait()
        loop.eval_wanted = anyio.Event()
        async with loop.activation_lock:
            version = fleet.live_version
            if version // every <= last_round:
                continue
            last_round = version // every
            step = loop.run.scheduler.done_steps
            loop.run.progress.state.status = f"running (evaluating v{version})"
            with anyio.move_on_after(loop.run.config.eval.timeout_s) as scope:
                record = await evaluator.run(fleet, step=step, version=version)
            loop.run.progress.state.status = "running"
        if scope.cancelled_caught:
            log.warning("eval.timed_out", version=version, seconds=loop.run.config.eval.timeout_s)
            continue
        loop.run.recorder.submit(record)
        loop.run.metrics.on_eval(record)
        if loop.run.tracking is not None:
            loop.run.tracking.evaluation(record)
        log.info("eval.done", step=step, version=version, task=record.task, k=record.k,
                 mean_at_k=record.mean_at_k, pass_at_k=record.pass_at_k, seconds=round(record.seconds, 2))
        loop.run.progress.state.last_eval = f"v{version} {describe(record)}"


def describe(record) -> str:
    """An eval record in a few words: "pass@4 0.250  mean@4 0.412"."""
    def shown(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    return f"pass@{record.k} {shown(record.pass_at_k)}  mean@{record.k} {shown(record.mean_at_k)}"
