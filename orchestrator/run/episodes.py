"""One multi-turn episode as one rollout of the run loop (issue #19, docs/multi-turn.md).

The scheduler sees an episode as it sees any rollout: dispatched once, to one engine, at the live
version; it ends in exactly one terminal record. Between dispatch and that end the task's
`run_episode` drives turns through `EpisodeTurns.sample`, which:

- sends every turn to the episode's engine (its prefix cache holds the episode so far), or to
  another serving engine once that one is fenced or died (the episode's tokens so far are the
  prompt: nothing is lost but the turn that was cut);
- lets an abort reach the episode between turns (the scheduler's abort of a stale rollout, a
  stop): the next turn is never sent;
- checks that the engine ran exactly the prompt sent, where the engine reports it (the
  in-process engine does): token in, token out, or the episode errors `prompt_mismatch`.

The episode becomes one completion: its tokens after the first prompt, their logprobs (NaN
where the environment wrote), per-token versions as change points (an activation between or
during turns shows as a change point at the first token the new version sampled), the
environment's spans, the turn count and why it ended; the reward is the episode's. An episode
cut at max_episode_tokens is completed with the reward its task gave the truncation (finish
reason "length"), never errored: a retry would only remove long episodes from the batch.
"""

from __future__ import annotations

import time

import msgspec

from orchestrator.errors import ActivationError, EngineError, FencedEngineError
from orchestrator.fleet.rollouts import FleetCompletion
from orchestrator.run.records import request_id
from orchestrator.scheduling import scheduler as sch
from orchestrator.tasks.env import Episode, SampledTurn
from replay.records import FINISH_LENGTH

# Kinds an episode errors with (besides the engine's own).
ENVIRONMENT_ERROR = "environment_error"
ENVIRONMENT_TIMEOUT = "environment_timeout"
NO_REWARD = "no_reward"
PROMPT_MISMATCH = "prompt_mismatch"


class EpisodeAborted(Exception):
    """The scheduler aborted the episode (or the run stops) between or during turns."""


class TurnFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class EpisodeTurns:
    """The sampler one episode's turns go through, and what they observed."""

    def __init__(self, loop, d: sch.Dispatch) -> None:
        self.loop = loop
        self.d = d
        self.engine = d.engine
        self.episode: Episode | None = None
        self.first: FleetCompletion | None = None  # turn 1's completion: dispatch version, timings
        self.last: FleetCompletion | None = None
        self.kv_carried = False

    def started(self, episode: Episode) -> None:
        self.episode = episode

    async def sample(self, prompt_ids: list[int], max_tokens: int) -> SampledTurn:
        loop, rid = self.loop, self.d.rollout_id
        if rid in loop.aborting or rid not in loop.run.scheduler.rollouts:
            raise EpisodeAborted("aborted between turns")
        run = loop.run
        sampling = run.sampling if max_tokens == run.sampling.max_tokens else msgspec.structs.replace(
            run.sampling, max_tokens=max_tokens)
        while True:
            fleet = run.fleet
            engine = self.engine if self.first is None or self.engine in fleet.coordinator.serving else None
            c = await fleet.generate(prompt_ids, sampling, engine_id=engine, request_id=request_id(rid),
                                     redispatch=False, final_only=True)
            if c.status == "completed":
                return self._turn(c, prompt_ids)
            if c.status == "dropped":
                if c.refused:
                    loop.keeper.engine_refused(c.engine_id)
                raise EpisodeAborted(c.message or "aborted during a turn")
            if c.reason == "engine_died":
                await loop.engine_dead(c.engine_id, c.message)
            elif c.reason == "engine_fenced":  # fenced under the turn (a death seen by an activation, say)
                loop._engines_fenced()
            if c.reason in ("engine_died", "engine_fenced") and self.first is not None and fleet.coordinator.serving:
                continue  # a later turn: the episode goes on on another engine, its tokens so far the prompt
            raise TurnFailed(c.reason, c.message)

    def _turn(self, c: FleetCompletion, prompt_ids: list[int]) -> SampledTurn:
        if c.engine_prompt_token_ids is not None and list(c.engine_prompt_token_ids) != list(prompt_ids):
            raise TurnFailed(PROMPT_MISMATCH, f"turn {self.episode.turns + 1 if self.episode else 1}: {c.engine_id} "
                                              f"ran a prompt of {len(c.engine_prompt_token_ids)} tokens that differs "
                                              f"from the {len(prompt_ids)} sent")
        if self.first is None:
            self.first = c
        self.last = c
        self.engine = c.engine_id
        self.kv_carried = self.kv_carried or c.kv_carried_across_versions
        return SampledTurn(c.token_ids, c.logprobs, c.changes, c.finish_reason)

    def completion(self, status: str, reason: str = "", message: str = "") -> FleetCompletion | None:
        """The episode so far as one completion (None when no turn completed)."""
        episode, first = self.episode, self.first
        if episode is None or first is None:
            return None
        values = episode.logprobs_with_gaps()
        return FleetCompletion(
            request_id(self.d.rollout_id), first.engine_id, list(episode.prompt_ids), list(episode.tokens), values,
            list(episode.changes), first.dispatched_version, self.kv_carried, status, reason,
            self._finish_reason(episode), dispatched_at=first.dispatched_at, first_token_at=first.first_token_at,
            finished_at=time.time(), message=message, environment_spans=list(episode.spans),
            episode_end=episode.ended)

    def _finish_reason(self, episode: Episode) -> str | None:
        """The episode's: "length" when it was cut at max_episode_tokens (the run saw the next
        turn would not fit), else its last turn's, as the engine reported it."""
        return FINISH_LENGTH if episode.truncated else self.last.finish_reason


async def episode_rollout(loop, d: sch.Dispatch) -> None:
    """Run the episode of dispatch `d` and hand its outcome to the scheduler (loop._finished)."""
    entry = loop.inflight[d.rollout_id]
    turns = EpisodeTurns(loop, d)
    try:
        episode = await loop.run.task.run_episode(loop.prompts[d.group_id], turns.sample,
                                                  loop.run.sampling.max_tokens, started=turns.started,
                                                  max_len=loop.run.config.engine.max_model_len)
    except EpisodeAborted as exc:
        _finish(loop, d, entry, turns, "aborted", message=str(exc), status="dropped")
        return
    except (EngineError, ActivationError) as exc:  # fenced before a turn started, or no engine left
        if turns.first is None and isinstance(exc, FencedEngineError) and loop.run.fleet.leaving_or_gone(d.engine):
            # its engine left before turn 1 started (drained, told to stop): sampled again elsewhere
            _finish(loop, d, entry, turns, "aborted", message=f"{d.engine} left the fleet before this episode "
                                                              "started: sampled again elsewhere", status="dropped")
            return
        loop._engines_fenced()
        _finish(loop, d, entry, turns, "errored", "engine_fenced", str(exc))
        return
    except TurnFailed as exc:
        _finish(loop, d, entry, turns, "errored", exc.kind, exc.message)
        return
    except TimeoutError as exc:  # an environment's step past step_timeout_s, or an agent past its timeout
        _finish(loop, d, entry, turns, "errored", ENVIRONMENT_TIMEOUT,
                str(exc) or "the environment's reset or step took longer than its step_timeout_s")
        return
    except Exception as exc:  # noqa: BLE001 - the environment's (the user's) code failed: this episode errors
        _finish(loop, d, entry, turns, "errored", ENVIRONMENT_ERROR, f"{type(exc).__name__}: {exc}"[:500])
        return
    except BaseException:
        # Cancelled (a stop past its grace): the caller records it aborted; its record keeps the
        # turns that completed.
        completion = turns.completion("dropped", "aborted")
        if completion is not None:
            entry.completion = completion
            _keep_prompt(entry, turns)
        raise
    if episode.reward is None:
        _finish(loop, d, entry, turns, "errored", NO_REWARD,
                f"the episode ended ({episode.ended}) after {episode.turns} turn(s) without a reward")
        return
    entry.rewards = {"reward": float(episode.reward)}
    _finish(loop, d, entry, turns, "completed", status="completed")


def _finish(loop, d, entry, turns: EpisodeTurns, outcome: str, kind: str = "", message: str = "",
            status: str = "errored") -> None:
    completion = turns.completion(status, kind, message)
    _keep_prompt(entry, turns)
    if outcome == "completed" and completion is None:  # cannot happen: a reward needs a turn
        outcome, kind, message = "errored", NO_REWARD, "the episode completed without a model turn"
    loop._finished(d, completion, outcome, kind, message)


def _keep_prompt(entry, turns: EpisodeTurns) -> None:
    """The record's prompt is the episode's first (known once the episode began)."""
    if turns.episode is not None and entry.ctx is not None:
        entry.ctx = msgspec.structs.replace(entry.ctx, prompt_token_ids=tuple(turns.episode.prompt_ids))
