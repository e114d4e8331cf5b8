"""Held-out evaluation: k samples of each eval prompt, mean@k and pass@k, labelled with the
versions that sampled them.

During `inflight run` (`[eval] every_steps`) the loop runs an evaluation on the live fleet while
the trainer keeps stepping and versions keep going live: an evaluation never holds an
activation (it would stall the trainer at the staleness bound for the evaluation's length).
Its tokens may therefore come from several versions; each sample records the versions of its
tokens (the per-token tags every completion carries), and the record says which: `versions`
(all of them), `version` (the one that sampled the most tokens), `mixed` (samples that span two
or more). A sample that spans versions is kept and labelled, not re-sampled: with a version going
live every step a re-sample could span again, without end. At most `eval.max_inflight` eval
requests are in flight at once, so the evaluation takes a bounded share of the engines.
`inflight eval` runs the same evaluation standalone on one version (one engine, no activation:
every token carries that version). Eval rollouts are never consumed.

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
from orchestrator.observe.progress import eval_versions
from orchestrator.scoring.outcome import ScoreFailed

log = get_logger(__name__)


class Sample(msgspec.Struct, frozen=True):
    prompt: int  # index into the evaluation's prompts
    rewards: dict[str, float] | None  # None: it ended without a score
    completion_tokens: int
    # version -> how many of its tokens that version sampled (a sample of no token: its
    # dispatched version, 0 tokens)
    version_tokens: dict[int, int] = msgspec.field(default_factory=dict)

    @property
    def versions(self) -> list[int]:
        return sorted(self.version_tokens)


def version_tokens(changes: Sequence[tuple[int, int]], n_tokens: int, dispatched: int) -> dict[int, int]:
    """Tokens per version from a completion's change points [(first token index, version), ...]."""
    if not changes:
        return {dispatched: 0}
    counts: dict[int, int] = {}
    ends = [start for start, _ in changes[1:]] + [n_tokens]
    for (start, version), end in zip(changes, ends):
        counts[version] = counts.get(version, 0) + end - start
    return counts


def label(samples_per_prompt: Sequence[Sequence[Sample]], due_version: int) -> tuple[int, list[int], int]:
    """(version, versions, mixed) of an evaluation, over its scored samples: the version that
    sampled the most tokens (a tie: the older), every version that sampled one, and how many
    samples span two or more. With no scored sample: the due version, [], 0."""
    totals: dict[int, int] = {}
    mixed = 0
    for group in samples_per_prompt:
        for s in group:
            if s.rewards is None:
                continue
            mixed += len(s.version_tokens) > 1
            for v, n in s.version_tokens.items():
                totals[v] = totals.get(v, 0) + n
    if not totals:
        return due_version, [], 0
    return max(totals, key=lambda v: (totals[v], -v)), sorted(totals), mixed


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

    async def run(self, fleet, *, step: int, version: int, concurrency: int | None = None):
        """One evaluation on `fleet`, due at its live version `version`; versions may go live
        while it runs (each sample is labelled with its tokens' versions). At most `concurrency`
        requests in flight (None: eval.max_inflight)."""
        from replay.records import EvalPrompt, EvalRecord

        started, started_at, self.rounds = time.monotonic(), time.time(), self.rounds + 1
        k = self.config.samples_per_prompt
        samples: list[list[Sample]] = [[] for _ in self.prompts]
        limiter = anyio.CapacityLimiter(concurrency or self.config.max_inflight)

        async def one(p: int, j: int) -> None:
            async with limiter:
                samples[p].append(await self._sample(fleet, p, j))

        async with anyio.create_task_group() as tg:
            for p in range(len(self.prompts)):
                for j in range(k):
                    tg.start_soon(one, p, j)
        mean, pass_at_k, components = summarize(samples, self.config.pass_threshold)
        labelled, versions, mixed = label(samples, version)
        results = [EvalPrompt(prompt_id=self.prompts[p].prompt_id,
                              rewards=[s.rewards["reward"] for s in group if s.rewards is not None],
                              completion_tokens=[s.completion_tokens for s in group if s.rewards is not None],
                              errored=sum(s.rewards is None for s in group),
                              versions=[s.versions for s in group if s.rewards is not None])
                   for p, group in enumerate(samples)]
        return EvalRecord(step=step, version=labelled, task=self.name, k=k, prompts=len(self.prompts),
                          mean_at_k=mean, pass_at_k=pass_at_k, pass_threshold=self.config.pass_threshold,
                          results=results, components=components, at=time.time(),
                          seconds=time.monotonic() - started, versions=versions, mixed=mixed,
                          due_version=version, started_at=started_at)

    async def _sample(self, fleet, p: int, j: int) -> Sample:
        from orchestrator.errors import ActivationError, EngineError

        prompt = self.prompts[p]
        try:
            # redispatch: under kv_policy = "abort" an activation aborts it; it is sampled again
            completion = await fleet.generate(prompt.token_ids, self.sampling,
                                              request_id=f"eval-{self.rounds}-{p}-{j}", redispatch=True,
                                              final_only=True)
        except (EngineError, ActivationError) as exc:
            log.warning("eval.sample_failed", prompt=prompt.prompt_id, error=str(exc))
            return Sample(p, None, 0)
        tokens = len(completion.token_ids)
        if completion.status != "completed":
            log.warning("eval.sample_failed", prompt=prompt.prompt_id, status=completion.status,
                        reason=completion.reason)
            return Sample(p, None, tokens)
        by_version = version_tokens(completion.changes, tokens, completion.dispatched_version)
        try:
            rewards = await self.scorer.score(prompt, completion.token_ids)
        except ScoreFailed as exc:
            log.warning("eval.score_failed", prompt=prompt.prompt_id, kind=exc.kind, error=exc.message)
            return Sample(p, None, tokens, by_version)
        return Sample(p, rewards, tokens, by_version)


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
        # No activation lock: versions keep going live while it runs (the module's docstring).
        version = fleet.live_version
        if version // every <= last_round:
            continue
        last_round = version // every
        step = loop.run.scheduler.done_steps
        loop.run.progress.state.status = f"running (evaluating from v{version})"
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
        log.info("eval.done", step=step, due_version=version, version=record.version, versions=record.versions,
                 mixed=record.mixed, task=record.task, k=record.k, mean_at_k=record.mean_at_k,
                 pass_at_k=record.pass_at_k, seconds=round(record.seconds, 2))
        loop.run.progress.state.last_eval = (f"{eval_versions(record.version, record.versions, record.mixed)} "
                                              f"{describe(record)}")


def describe(record) -> str:
    """An eval record in a few words: "pass@4 0.250  mean@4 0.412"."""
    def shown(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    return f"pass@{record.k} {shown(record.pass_at_k)}  mean@{record.k} {shown(record.mean_at_k)}"
