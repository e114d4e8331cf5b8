"""Multi-turn environments and the episode they produce (issue #19).

An environment is what `[task] entrypoint` may return for multi-turn work:

    class Env(Environment):
        max_turns = 3
        max_episode_tokens = 512
        async def reset(self, row) -> list[dict]:            # the first messages
        async def step(self, episode) -> tuple[list[dict], float | None, bool]:
            # after each model turn: (new messages, reward or None, done)

`run_episode` drives one: turn 1's prompt is the template's rendering of `reset`'s messages;
each later turn's prompt is the episode's exact tokens so far plus the template's delta for
the new messages (`turns.TurnRenderer.delta`): earlier turns are never tokenized again. The
`Episode` keeps one token sequence after the first prompt, which tokens were sampled (the loss
mask), a logprob for every sampled token and none for the environment's, and the version of
every sampled token as change points (token index, version): one episode spans versions when
activations land between or during its turns.

An episode cut by `max_episode_tokens` (the next turn would not fit) is a truncation, an outcome
like any other (issue #30): when no step gave it a reward, the environment's `score(episode,
row, truncated=True)` scores it where `score` takes a `truncated` parameter, else it gets the
task's `truncation_reward` (0.0 by default). A `score` without that parameter is never called
for a truncated episode: it was written for episodes that ended on their own terms.

`ToolEnvironment` is an environment whose tools are plain Python functions
(`tools.tool_schema` describes them in the system prompt); each model turn's tool calls are
parsed (Hermes / Qwen format) and run, their results (or errors) answer as `tool` messages; a
turn without calls ends the episode and is scored; a call that does not parse ends it with
`malformed_tool_call`. Its user hooks (`prompt`, each tool, `score`) go through the runner of
the call the step runs in (`user_code.current()`): a plain `def` in a worker thread, never on
the loop that the episodes' steps share, each bounded by `step_timeout_s`.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.tasks.tools import MalformedToolCall, call_tool, parse_tool_calls, tool_schema
from orchestrator.tasks.turns import TurnRenderer
from orchestrator.tasks.user_code import current, is_async

# Why an episode ended (Episode.ended).
DONE = "done"  # the environment said so
MAX_TURNS = "max_turns"
MAX_EPISODE_TOKENS = "max_episode_tokens"
MALFORMED_TOOL_CALL = "malformed_tool_call"
_NAN = float("nan")


class Environment:
    """The multi-turn seam; subclass and implement `reset` and `step`."""

    max_turns: int = 4
    max_episode_tokens: int = 1024
    step_timeout_s: float = 30.0
    # False: reset/step run off the run's event loop (tasks/user_code.py): an async one on the
    # user-code loop, a plain def in a worker thread. True: an async environment that never blocks
    # (no CPU-heavy work, no blocking I/O) runs on the run's loop: no thread hop per turn
    # (multi_turn_overhead_ratio_on_loop).
    on_loop: bool = False

    async def reset(self, row: dict) -> list[dict]:
        raise NotImplementedError

    async def step(self, episode: Episode) -> tuple[list[dict], float | None, bool]:
        raise NotImplementedError


@dataclass(frozen=True)
class SampledTurn:
    """What the engine returned for one turn."""

    token_ids: list[int]
    logprobs: list[float]
    changes: list[tuple[int, int]]  # (index in token_ids, version), non-decreasing versions
    finish_reason: str | None = None


@dataclass
class Episode:
    row: dict
    messages: list[dict]
    prompt_ids: list[int]  # turn 1's prompt
    tokens: list[int] = field(default_factory=list)  # everything after it, in order
    sampled: list[bool] = field(default_factory=list)  # per token: sampled (trained on) or the environment's
    logprobs: list[float] = field(default_factory=list)  # one per sampled token, in order
    changes: list[tuple[int, int]] = field(default_factory=list)  # (index in tokens, version) of sampled ones
    turns: int = 0  # model turns
    reward: float | None = None
    ended: str | None = None
    detail: str = ""  # e.g. why a tool call was malformed
    state: dict = field(default_factory=dict)  # the environment's own, per episode
    spans: list[tuple[int, int]] = field(default_factory=list)  # (start, end) in tokens the environment wrote

    @property
    def truncated(self) -> bool:
        """Cut at max_episode_tokens: the next model turn would not fit."""
        return self.ended == MAX_EPISODE_TOKENS

    def next_prompt(self) -> list[int]:
        return self.prompt_ids + self.tokens

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def environment_tokens(self) -> int:
        return self.sampled.count(False)

    def last_reply(self) -> str:
        return self.messages[-1]["content"] if self.messages and self.messages[-1]["role"] == "assistant" else ""

    def add_sampled(self, turn: SampledTurn) -> None:
        if len(turn.logprobs) != len(turn.token_ids):
            raise ValueError(f"{len(turn.logprobs)} logprobs for {len(turn.token_ids)} sampled tokens")
        start = len(self.tokens)
        for index, version in turn.changes:
            if not self.changes or self.changes[-1][1] != version:
                self.changes.append((start + index, version))
        self.tokens += turn.token_ids
        self.sampled += [True] * len(turn.token_ids)
        self.logprobs += turn.logprobs
        self.turns += 1

    def add_environment(self, token_ids: Sequence[int]) -> None:
        if token_ids:
            self.spans.append((len(self.tokens), len(self.tokens) + len(token_ids)))
        self.tokens += token_ids
        self.sampled += [False] * len(token_ids)

    def logprobs_with_gaps(self) -> list[float]:
        """One logprob per token of `tokens`: NaN where the environment wrote (none exists)."""
        out: list[float] = []
        taken = at = 0
        for start, end in self.spans:
            out += self.logprobs[taken:taken + start - at]
            taken += start - at
            out += [_NAN] * (end - start)
            at = end
        out += self.logprobs[taken:]
        return out


Sampler = Callable[[list[int], int], Awaitable[SampledTurn]]  # (prompt ids, max new tokens) -> turn
# call(fn, *args): await fn(*args) wherever the environment's code runs, bounded by its timeout.
EnvCall = Callable[..., Awaitable]


async def run_episode(env: Environment, renderer: TurnRenderer, sample: Sampler, row: dict,
                      max_tokens_per_turn: int, *, call: EnvCall | None = None,
                      started: Callable[[Episode], None] | None = None, max_len: int | None = None,
                      truncation_reward: float = 0.0) -> Episode:
    """One episode to its end (`Episode.ended`); `sample` runs one turn on an engine, `call`
    runs the environment's `reset` and `step` (default: an async one on this loop, a plain one
    in a worker thread, each bounded by `env.step_timeout_s`); `started(episode)` is told the
    episode once it exists (so a caller can record what it holds if a later turn fails);
    `max_len` (the engines' context length) lowers the environment's `max_episode_tokens`
    where it is smaller. A truncated episode without a reward is scored (`score_truncated`),
    `truncation_reward` where the environment's `score` does not take `truncated`."""
    call = call or _on_this_loop(env.step_timeout_s)
    episode = await _turns(env, renderer, sample, row, max_tokens_per_turn, call, started, max_len)
    if episode.truncated and episode.reward is None and episode.turns:
        episode.reward = await score_truncated(env, episode, call, truncation_reward)
    return episode


async def score_truncated(env, episode: Episode, call: EnvCall, truncation_reward: float) -> float:
    """The reward of an episode cut at max_episode_tokens: `env.score(episode, row,
    truncated=True)` where the environment's `score` takes `truncated`, else `truncation_reward`."""
    score = getattr(env, "score", None)
    if not callable(score) or not _takes_truncated(score):
        return float(truncation_reward)
    if is_async(score):
        async def scored(episode, row):
            return await score(episode, row, truncated=True)
    else:
        def scored(episode, row):
            return score(episode, row, truncated=True)
    scored.__name__ = "score"  # the runner's timeout message names "the environment's score"
    value = await call(scored, episode, episode.row)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"the environment's score(..., truncated=True) returned {value!r}: a finite number")
    return float(value)


def _takes_truncated(fn) -> bool:
    """Whether `fn` accepts a keyword `truncated` (named, or through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: it cannot be told
        return False
    return any(p.name == "truncated" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               or p.kind == p.VAR_KEYWORD for p in parameters)


async def _turns(env: Environment, renderer: TurnRenderer, sample: Sampler, row: dict, max_tokens_per_turn: int,
                 call: EnvCall, started: Callable[[Episode], None] | None, max_len: int | None) -> Episode:
    """The episode's turns, until it ends (`Episode.ended`)."""
    limit = min(env.max_episode_tokens, max_len) if max_len else env.max_episode_tokens
    messages = _messages(await call(env.reset, row), "reset")
    episode = Episode(row=row, messages=messages, prompt_ids=renderer.first_prompt(messages))
    if started is not None:
        started(episode)
    while True:
        room = limit - episode.length
        if room <= 0:
            episode.ended = MAX_EPISODE_TOKENS
            return episode
        history = list(episode.messages)
        turn = await sample(episode.next_prompt(), min(max_tokens_per_turn, room))
        episode.add_sampled(turn)
        new, reward, done = _step_result(await call(_after_the_reply(env.step, renderer, turn.token_ids), episode))
        if reward is not None:
            episode.reward = float(reward)
        if episode.ended is not None:  # the environment ended it with a reason of its own
            return episode
        if done:
            episode.ended = DONE
            return episode
        if episode.turns >= env.max_turns:
            episode.ended = MAX_TURNS
            return episode
        delta = renderer.delta(history, turn.token_ids, new)
        if episode.length + len(delta) >= limit:
            episode.ended = MAX_EPISODE_TOKENS  # no room left for a model turn after the environment's
            return episode
        episode.add_environment(delta)
        episode.messages += new


def _on_this_loop(timeout_s: float) -> EnvCall:
    # An async reset/step awaited here, a plain one in a worker thread, through the runner of the
    # call this runs in (or the process's default): the tools it calls find that runner.
    async def call(fn, *args):
        return await current().call(fn, *args, timeout_s=timeout_s, here=True,
                                    what=f"the environment's {getattr(fn, '__name__', 'call')}")
    return call


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value):
        raise TypeError(f"the environment's {where}() must return a list of {{role, content}} messages, "
                        f"got {str(value)[:80]}")
    return list(value)


def _step_result(value) -> tuple[list[dict], float | None, bool]:
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"the environment's step() must return (messages, reward or None, done), got {str(value)[:80]}")
    new, reward, done = value
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or reward != reward or abs(reward) == float("inf")):
        raise TypeError(f"the environment's step() returned reward {reward!r}: a finite number or None")
    return _messages(new, "step"), reward, bool(done)


def _after_the_reply(step, renderer: TurnRenderer, token_ids: Sequence[int]):
    """`step`, which first gives the episode the assistant message of the turn just sampled: its
    text is decoded where the step runs (the environment's thread or loop), not on the run's loop,
    which meanwhile streams the other rollouts (a turn's decode is ~50 us of its loop time:
    `multi_turn_overhead_ratio`). Named and typed as `step`, for the runner and its errors."""
    def reply(episode: Episode) -> None:
        episode.messages.append({"role": "assistant", "content": _reply_text(renderer, token_ids)})

    if is_async(step):
        async def run(episode: Episode):
            reply(episode)
            return await step(episode)
    else:
        def run(episode: Episode):
            reply(episode)
            return step(episode)
    run.__name__ = getattr(step, "__name__", "step")
    return run


def _reply_text(renderer: TurnRenderer, token_ids: Sequence[int]) -> str:
    """The reply's text, without the stop token that ended it (any the engine stops on)."""
    return renderer.decode(renderer.reply_ids(token_ids))


class ToolEnvironment(Environment):
    """Tools as plain functions; `prompt(row)` the first user message; `score(episode, row)`
    the reward once the model answers without calling a tool."""

    tools: Sequence[Callable] = ()
    system_prompt: str = "You may call tools. To call one, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."

    def prompt(self, row: dict) -> str:
        raise NotImplementedError

    def score(self, episode: Episode, row: dict) -> float:
        raise NotImplementedError

    async def reset(self, row: dict) -> list[dict]:
        schemas = [tool_schema(fn) for fn in self.tools]
        system = self.system_prompt + "\nTools:\n" + "\n".join(json.dumps(s) for s in schemas)
        prompt = await current().call(self.prompt, row, timeout_s=self.step_timeout_s,
                                      what="the environment's prompt")
        return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]

    async def step(self, episode: Episode) -> tuple[list[dict], float | None, bool]:
        calls = parse_tool_calls(episode.last_reply())
        if isinstance(calls, MalformedToolCall):
            # The environment's rule, documented: a call that does not parse scores 0.
            episode.ended, episode.detail = MALFORMED_TOOL_CALL, calls.reason
            return [], 0.0, True
        if not calls:
            score = await current().call(self.score, episode, episode.row, timeout_s=self.step_timeout_s,
                                         what="the environment's score")
            return [], float(score), True
        by_name = {fn.__name__: fn for fn in self.tools}
        answers = [await call_tool(by_name, c, timeout_s=self.step_timeout_s) for c in calls]
        return [{"role": "tool", "content": answer} for answer in answers], None, False
