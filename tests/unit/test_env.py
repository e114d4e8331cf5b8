"""Multi-turn episodes (orchestrator/tasks/env.py) on the local model's tokenizer and template,
with a scripted sampler in place of the engine (the engine's part is tested on real engines
elsewhere; here: the episode's bookkeeping). Every turn's prompt is exactly the episode's
tokens so far; environment tokens carry no logprob and are not sampled; versions are kept as
change points over the sampled tokens."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.tasks.env import (
    DONE,
    MALFORMED_TOOL_CALL,
    MAX_EPISODE_TOKENS,
    MAX_TURNS,
    Environment,
    SampledTurn,
    ToolEnvironment,
    run_episode,
)
from orchestrator.tasks.turns import TurnRenderer


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    from transformers import AutoTokenizer

    return TurnRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


class Feedback(Environment):
    """Answers each turn with feedback; the reward comes after the third."""

    max_turns = 5

    async def reset(self, row):
        return [{"role": "user", "content": f"Say {row['n']}."}]

    async def step(self, episode):
        if episode.turns < 3:
            return [{"role": "user", "content": f"Again ({episode.turns})."}], None, False
        return [], 1.0 if episode.last_reply() == str(episode.row["n"]) else 0.0, True


class Script:
    """Replies in turn; each with its version; records every prompt it was given."""

    def __init__(self, renderer, replies, versions, stop=True):
        self.r, self.replies, self.versions, self.stop = renderer, list(replies), list(versions), stop
        self.prompts: list[list[int]] = []

    async def __call__(self, prompt, max_new):
        self.prompts.append(list(prompt))
        ids = self.r.encode(self.replies.pop(0))[:max_new]
        if self.stop:
            ids.append(self.r.eos_id)
        v = self.versions.pop(0)
        return SampledTurn(ids, [-0.5] * len(ids), [(0, v)], "stop")


async def test_a_three_turn_episode_keeps_one_token_sequence_with_a_loss_mask(renderer):
    sampler = Script(renderer, ["7", "7", "7"], versions=[1, 1, 2])
    ep = await run_episode(Feedback(), renderer, sampler, {"n": 7}, max_tokens_per_turn=16)
    assert (ep.ended, ep.turns, ep.reward) == (DONE, 3, 1.0)
    # every turn's prompt is the previous prompt + what was sampled + the environment's delta
    for before, after in zip(sampler.prompts, sampler.prompts[1:]):
        assert after[:len(before)] == before
    assert ep.next_prompt()[:len(sampler.prompts[-1])] == sampler.prompts[-1]
    # in the canonical case, the same tokens as rendering the whole conversation at once (which
    # goes on past the last stop token the model sampled: the template's "\n" after it)
    whole = renderer.encode(renderer.render(ep.messages, add_generation_prompt=False))
    assert whole[:len(ep.next_prompt())] == ep.next_prompt()
    assert renderer.tokenizer.decode(whole[len(ep.next_prompt()):]) == "\n"
    sampled = [t for t, s in zip(ep.tokens, ep.sampled) if s]
    assert len(ep.logprobs) == len(sampled) == 3 * 2  # "7" + stop token, three times
    assert ep.environment_tokens == len(ep.tokens) - len(sampled) > 0
    third = [i for i, s in enumerate(ep.sampled) if s][4]
    assert ep.changes == [(0, 1), (third, 2)], "the activation between turns 2 and 3 shows at turn 3's first token"


async def test_the_turn_and_token_limits_end_an_episode(renderer):
    class Forever(Feedback):
        max_turns = 2

        async def step(self, episode):
            return [{"role": "user", "content": "more"}], None, False

    ep = await run_episode(Forever(), renderer, Script(renderer, ["a"] * 9, [0] * 9), {"n": 1}, 16)
    assert (ep.ended, ep.turns, ep.reward) == (MAX_TURNS, 2, None), "no reward given: none is invented"

    class Short(Forever):
        max_turns = 99
        max_episode_tokens = 40

    sampler = Script(renderer, ["word " * 30] * 9, [0] * 9, stop=False)
    ep = await run_episode(Short(), renderer, sampler, {"n": 1}, 64)
    assert ep.ended == MAX_EPISODE_TOKENS and ep.length <= 40
    assert all(len(p) < 40 for p in sampler.prompts)


class Rambling(Feedback):
    """Never done, never a reward: only max_episode_tokens ends it."""

    max_turns = 99
    max_episode_tokens = 40

    async def step(self, episode):
        return [{"role": "user", "content": "more"}], None, False


def rambling(renderer) -> Script:
    return Script(renderer, ["word " * 30] * 9, [0] * 9, stop=False)


async def test_a_truncated_episode_is_scored_by_a_score_that_takes_truncated(renderer):
    class Judged(Rambling):
        def __init__(self):
            self.calls = []

        def score(self, episode, row, truncated=False):
            self.calls.append((episode.turns, row, truncated))
            return -0.5

    env = Judged()
    ep = await run_episode(env, renderer, rambling(renderer), {"n": 1}, 64, truncation_reward=0.25)
    assert ep.ended == MAX_EPISODE_TOKENS and ep.truncated
    assert env.calls == [(ep.turns, {"n": 1}, True)], "called once, told the episode was cut"
    assert ep.reward == -0.5, "its own value, not truncation_reward"


async def test_an_async_score_with_only_keyword_truncated_is_awaited(renderer):
    class Judged(Rambling):
        async def score(self, episode, row, *, truncated):
            return 0.75 if truncated else 1.0

    ep = await run_episode(Judged(), renderer, rambling(renderer), {"n": 1}, 64)
    assert (ep.ended, ep.reward) == (MAX_EPISODE_TOKENS, 0.75)


@pytest.mark.parametrize("with_score", [False, True])
async def test_a_truncated_episode_gets_truncation_reward_when_score_cannot_be_told(renderer, with_score):
    calls = []

    class Plain(Rambling):
        if with_score:
            def score(self, episode, row):  # written for episodes that ended on their own terms
                calls.append(episode.turns)
                return 1.0

    ep = await run_episode(Plain(), renderer, rambling(renderer), {"n": 1}, 64, truncation_reward=0.25)
    assert (ep.ended, ep.reward) == (MAX_EPISODE_TOKENS, 0.25)
    assert calls == [], "a score without `truncated` is never called for a cut episode"
    ep = await run_episode(Plain(), renderer, rambling(renderer), {"n": 1}, 64)
    assert ep.reward == 0.0, "the default truncation_reward"


async def test_a_reward_a_step_gave_stands_and_a_truncated_score_must_be_a_number(renderer):
    class Early(Rambling):
        async def step(self, episode):
            return [{"role": "user", "content": "more"}], 0.5, False

        def score(self, episode, row, truncated=False):
            raise AssertionError("not called: the episode has a reward")

    ep = await run_episode(Early(), renderer, rambling(renderer), {"n": 1}, 64, truncation_reward=0.25)
    assert (ep.ended, ep.reward) == (MAX_EPISODE_TOKENS, 0.5)

    class Bad(Rambling):
        def score(self, episode, row, truncated=False):
            return float("nan")

    with pytest.raises(TypeError, match="truncated=True"):
        await run_episode(Bad(), renderer, rambling(renderer), {"n": 1}, 64)


async def test_an_episode_that_ends_otherwise_is_not_scored_as_truncated(renderer):
    class Judged(Rambling):
        max_turns = 2
        max_episode_tokens = 1 << 20

        def score(self, episode, row, truncated=False):
            raise AssertionError("only a truncated episode is scored here")

    ep = await run_episode(Judged(), renderer, rambling(renderer), {"n": 1}, 8, truncation_reward=0.25)
    assert (ep.ended, ep.reward, ep.truncated) == (MAX_TURNS, None, False)


async def test_a_step_past_its_timeout_fails_the_episode(renderer):
    class Slow(Feedback):
        step_timeout_s = 0.05

        async def step(self, episode):
            await anyio.sleep(5)

    with pytest.raises(TimeoutError):
        await run_episode(Slow(), renderer, Script(renderer, ["1"], [0]), {"n": 1}, 8)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


class Calculator(ToolEnvironment):
    tools = (add, divide)

    def prompt(self, row):
        return f"What is {row['a']} + {row['b']}?"

    def score(self, episode, row):
        return 1.0 if episode.last_reply().strip() == str(row["a"] + row["b"]) else 0.0


async def test_a_tool_call_is_run_and_its_result_answers_as_a_tool_message(renderer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    ep = await run_episode(Calculator(), renderer, Script(renderer, [call, "5"], [0, 0]), {"a": 2, "b": 3}, 64)
    assert (ep.ended, ep.turns, ep.reward) == (DONE, 2, 1.0)
    assert "add" in ep.messages[0]["content"] and '"type": "integer"' in ep.messages[0]["content"]
    assert {"role": "tool", "content": "5"} in ep.messages


async def test_a_failing_tool_answers_with_its_error_and_a_malformed_call_ends_the_episode(renderer):
    bad = '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
    ep = await run_episode(Calculator(), renderer, Script(renderer, [bad, "?"], [0, 0]), {"a": 2, "b": 3}, 64)
    assert ep.messages[-2]["role"] == "tool" and "ZeroDivisionError" in ep.messages[-2]["content"]
    assert (ep.ended, ep.reward) == (DONE, 0.0)
    torn = '<tool_call>{"name": "add", "arguments": {"a": 2'
    ep = await run_episode(Calculator(), renderer, Script(renderer, [torn], [0]), {"a": 2, "b": 3}, 64)
    assert ep.ended == MALFORMED_TOOL_CALL and ep.reward == 0.0 and "opened" in ep.detail
