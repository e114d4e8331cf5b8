"""Agents on a real vLLM engine (the in-process engine on the locally built tiny model): an agent
written against the `openai` client, and a verifiers MultiTurnEnv through the adapter, talk to the
agent endpoint over HTTP; the endpoint sends every turn to the engine. The episode must hold
exactly the tokens and logprobs the engine returned, turn after turn, each turn's prompt the
episode so far (checked against a plain transformers forward of the same weights)."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from transformers import AutoTokenizer

from orchestrator.tasks.agent_endpoint import AgentEndpoint
from orchestrator.engines.base import SamplingSettings
from orchestrator.tasks.agent import AgentEpisodes, sampling_checker
from orchestrator.tasks.env import SampledTurn
from orchestrator.tasks.turns import TurnRenderer
from tests.agent_helpers import served
from tests.reference import reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

SAMPLING = SamplingSettings(seed=7, ignore_eos=True)  # no early stop: every reply has text
_ids = itertools.count()


class EngineSampler:
    """The run's part, reduced: one engine request per turn; keeps what the engine returned."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.turns: list[tuple[list[int], list[int], list[float]]] = []  # (prompt, tokens, logprobs)

    async def __call__(self, prompt: list[int], max_new: int) -> SampledTurn:
        sampling = msgspec.structs.replace(SAMPLING, max_tokens=max_new)
        ids, logprobs, reason = [], [], None
        async for chunk in self.engine.generate(f"agent-{next(_ids)}", prompt, sampling, final_only=True):
            ids += chunk.token_ids
            logprobs += chunk.logprobs
            reason = chunk.finish_reason or reason
        self.turns.append((list(prompt), list(ids), list(logprobs)))
        return SampledTurn(ids, logprobs, [(0, 0)], reason)


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return TurnRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


async def test_an_openai_agent_for_three_turns_records_what_the_engine_sampled(inproc_engine, renderer,
                                                                                 tiny_model_dir, tmp_path):
    endpoint = AgentEndpoint(renderer, token="t", sampling_check=sampling_checker(SAMPLING))
    replies = []

    async def agent(client, row):
        messages = [{"role": "user", "content": row["question"]}]
        for turn in range(3):
            r = await client.chat.completions.create(model="tiny", messages=messages, temperature=1.0,
                                                     max_tokens=6, logprobs=True)
            replies.append(r.choices[0])
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"Go on ({turn})."}]
        return 0.5

    sampler = EngineSampler(inproc_engine)
    async with served(endpoint, tmp_path) as url:
        ep = await AgentEpisodes(agent, endpoint, lambda: url, timeout_s=300).run_episode(
            {"question": "Write digits:"}, sampler, 16)
    assert (ep.turns, ep.reward) == (3, 0.5)
    sampled = [t for t, s in zip(ep.tokens, ep.sampled) if s]
    assert sampled == sum((ids for _, ids, _ in sampler.turns), []) and len(sampled) == 18
    assert ep.logprobs == sum((lps for _, _, lps in sampler.turns), [])
    assert [[i.logprob for i in r.logprobs.content] for r in replies] == [lps for _, _, lps in sampler.turns]
    assert ep.changes == [(0, 0)]
    # each turn's prompt is the episode so far, and the engine's logprobs are the model's on it
    for k, (prompt, ids, logprobs) in enumerate(sampler.turns):
        assert ep.next_prompt()[:len(prompt) + len(ids)] == prompt + ids, f"turn {k + 1}"
        expected = reference_logprobs(str(tiny_model_dir), prompt, ids)
        assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-3, f"turn {k + 1}"


async def test_a_verifiers_multi_turn_environment_through_the_adapter(inproc_engine, renderer, tmp_path):
    from orchestrator.tasks.verifiers import make
    from tests.vf_toy_env import digit_share

    task = make("tests.vf_toy_env", kind="multi", rows=2)
    endpoint = AgentEndpoint(renderer, token="t", sampling_check=sampling_checker(SAMPLING))
    sampler = EngineSampler(inproc_engine)
    async with served(endpoint, tmp_path) as url:
        ep = await AgentEpisodes(task.run, endpoint, lambda: url, timeout_s=300).run_episode(task.row(0), sampler, 8)
    assert ep.turns == 3 and [m["content"] for m in ep.messages if m["role"] == "user"][1:] == ["again", "again"]
    assert [t for t, s in zip(ep.tokens, ep.sampled) if s] == sum((ids for _, ids, _ in sampler.turns), [])
    assert ep.logprobs == sum((lps for _, _, lps in sampler.turns), [])
    replies = [m for m in ep.messages if m["role"] == "assistant"]
    assert ep.reward == pytest.approx(digit_share(replies)), "the rubric's score of what the engine wrote"
