"""Any agent as a multi-turn task (issue #19, docs/agents.md): the user's

    async def run(client: openai.AsyncOpenAI, row: dict) -> float     (or a plain def, given openai.OpenAI)

talks to the run's OpenAI-compatible endpoint (`orchestrator.tasks.agent_endpoint`) for as many turns
as it likes; every call is recorded into its episode with exact tokens, logprobs and versions,
and the number it returns is the episode's reward.

The agent runs off the run's event loop, through the run's user-code runner (`user_code.py`):
in a worker thread of its own for the whole episode (the run's threads follow
`scheduler.max_inflight`, one per episode in flight), an async agent on that thread's own event
loop (`user_code.call_in_thread`); its client is made in that thread, with the run's token as
api_key and a base URL naming the episode (`{base}/e/{episode}/v1`, so a client made from the
base URL and key alone, an Agents SDK model or a LangChain ChatOpenAI, lands in the episode too;
the `X-Inflight-Episode` header says it again), and closed after. It is bounded
by `timeout_s`, counted from when its thread starts it (never the wait for a thread): past it
the episode ends with `AgentTimeout` (Python cannot stop the thread; it is abandoned, left to
finish, and its later calls get 404). The episode is closed whatever happens (a call in flight
is cancelled). When the engine's turn failed inside a call, that failure is raised (as the run's
own sampler raised it), whatever the agent made of its HTTP error.

An episode whose last call the endpoint refused for the context length (max_episode_tokens, a
400 worded as vLLM's) is truncated (issue #30): scored by what the agent returned, or
`task.truncation_reward` when the agent raised (the openai client raises BadRequestError on the
400); recorded `episode_end = max_episode_tokens`, finish reason "length", never errored.

`sampling_checker(settings)` is the endpoint's `sampling_check` for a run sampling with
`settings`: a call may repeat them, never ask for others.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable


from orchestrator.errors import ConfigError, UserCodeTimeout
from orchestrator.tasks.agent_endpoint import EPISODE_HEADER, SAMPLING_FIELDS, AgentEndpoint
from orchestrator.tasks.env import DONE, MAX_EPISODE_TOKENS, Episode, Sampler
from orchestrator.tasks.user_code import UserCode, call_in_thread, is_async


class AgentError(Exception):
    """The agent failed: it raised, returned no number, or never called the endpoint."""


class AgentTimeout(UserCodeTimeout):
    """The agent ran past its timeout."""


class AgentEpisodes:
    """Runs episodes of one agent function against one endpoint, through `user_code` (the
    run's runner; by default one of its own)."""

    def __init__(self, run_fn, endpoint: AgentEndpoint, base_url_fn: Callable[[], str], *, timeout_s: float,
                 user_code: UserCode | None = None, truncation_reward: float = 0.0) -> None:
        if not callable(run_fn):
            raise TypeError(f"the agent must be a function run(client, row), got {type(run_fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.run_fn = run_fn
        self.endpoint = endpoint
        self.base_url_fn = base_url_fn
        self.timeout_s = timeout_s
        self.name = getattr(run_fn, "__qualname__", type(run_fn).__name__)
        self.user_code = user_code or UserCode()
        self.truncation_reward = truncation_reward

    async def run_episode(self, row: dict, sample: Sampler, max_tokens_per_turn: int,
                          started: Callable[[Episode], None] | None = None, max_len: int | None = None) -> Episode:
        """One episode of the agent on `row`; `max_len`: the most tokens it may grow to."""
        episode_id = self.endpoint.open_episode(row, sample, max_tokens_per_turn, started=started,
                                                max_episode_tokens=max_len)
        error = None
        try:
            value = await self._run_agent(episode_id, row)
        except (AgentError, AgentTimeout) as exc:
            value, error = None, exc
        finally:  # also on cancellation: the episode is closed, its call in flight cancelled
            failure = self.endpoint.failure(episode_id)
            truncated = self.endpoint.truncated(episode_id)
            episode = self.endpoint.close_episode(episode_id)
        if failure is not None:  # the engine's turn failed: raised as the run's sampler raised it
            raise failure from error
        if truncated and episode is not None and not isinstance(error, AgentTimeout):
            return self._truncated(episode, value, error)
        if error is not None:
            raise error
        if episode is None:
            raise AgentError(f"the agent {self.name} returned without calling the endpoint: an episode needs at "
                             "least one model turn (use the client it is given)")
        episode.reward = _reward(value, self.name)
        episode.ended = DONE
        return episode

    def _truncated(self, episode: Episode, value, error: AgentError | None) -> Episode:
        """An episode whose last call was refused for the context length: cut at
        max_episode_tokens. The agent's reward where it returned one (it read the refusal and
        scored the truncation); `truncation_reward` where it raised (most agents raise on a 400):
        the truncation is the episode's outcome, not the agent's error."""
        episode.ended = MAX_EPISODE_TOKENS
        episode.reward = self.truncation_reward if error is not None else _reward(value, self.name)
        return episode

    async def _run_agent(self, episode_id: str, row: dict):
        base_url = f"{self.base_url_fn().rstrip('/')}/e/{episode_id}/v1"
        args = (self.run_fn, base_url, self.endpoint.token, episode_id, copy.deepcopy(row), self.timeout_s)
        what = f"the agent {self.name}"
        try:
            return await self.user_code.call(_call_agent, *args, timeout_s=self.timeout_s, what=what)
        except UserCodeTimeout as exc:
            if exc.what != what:  # one raised inside the agent, not this call's: the agent's own error
                raise AgentError(f"{what} raised {type(exc).__name__}: {exc}") from exc
            raise AgentTimeout(what, self.timeout_s, where=exc.where) from None
        except Exception as exc:  # noqa: BLE001 - the user's code: its failure ends this episode, named
            raise AgentError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _call_agent(run_fn, base_url: str, token: str, episode_id: str, row: dict, timeout_s: float):
    """In a worker thread: the agent with a client of its kind (async or not), made here."""
    import openai

    # No retries: a refused call is not retried into a second turn, a failed one fails the episode.
    options = {"base_url": base_url, "api_key": token, "default_headers": {EPISODE_HEADER: episode_id},
               "max_retries": 0, "timeout": timeout_s}
    if not is_async(run_fn):
        with openai.OpenAI(**options) as client:
            return call_in_thread(run_fn, client, row)

    async def with_client():
        client = openai.AsyncOpenAI(**options)
        try:
            return await run_fn(client, row)
        finally:
            await client.close()
    return call_in_thread(with_client)


def _reward(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise AgentError(f"the agent {name} returned {value!r}: it must return the episode's reward, a finite "
                         "number (not a bool)")
    return float(value)


def sampling_checker(settings) -> Callable[[dict], None]:
    """The `sampling_check` of an `AgentEndpoint`: a request may repeat the run's own settings
    (`replay.records.SamplingSettings`), never ask for others (ConfigError naming the field)."""
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "length_penalty": 1,
               "best_of": 1, "logit_bias": {}, "response_format": {"type": "text"}}
    own = {"temperature": settings.temperature, "top_p": settings.top_p, "min_p": settings.min_p,
           "seed": settings.seed, "min_tokens": settings.min_tokens, "ignore_eos": settings.ignore_eos,
           "top_k": -1 if settings.top_k in (0, -1) else settings.top_k, "stop": tuple(settings.stop),
           "stop_token_ids": tuple(settings.stop_token_ids)}

    def normal(name: str, value):
        if name == "top_k" and value == 0:
            return -1
        if name == "stop":
            return (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value
        return tuple(value) if name == "stop_token_ids" and isinstance(value, list) else value

    def check(body: dict) -> None:
        for name in sorted(SAMPLING_FIELDS):
            value = body.get(name)
            if value is None:
                continue
            expected = own[name] if name in own else neutral.get(name, None)
            if isinstance(value, bool) != isinstance(expected, bool) or normal(name, value) != expected:
                raise ConfigError(name, f"the run samples with {name} = {expected!r}, the request asks {value!r}: "
                                        "an agent's calls sample with the run's settings (its records say so)")
    return check
