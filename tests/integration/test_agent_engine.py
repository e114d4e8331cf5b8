"""Agents on a real vLLM engine (the in-process engine on the locally built tiny model): an agent
written against the `openai` client, a verifiers MultiTurnEnv through the adapter, and agents
written with the OpenAI Agents SDK (Responses API, plain and streamed) and LangChain (streamed chat)
talk to the agent endpoint over HTTP; the endpoint sends every turn to the engine. The episode must
hold exactly the tokens and logprobs the engine returned, turn after turn, each turn's prompt the
episode so far (checked against a plain transformers forward of the same weights). The framework
agents run on tiny-rl tuned for seconds to call their `add` tool (`tool_agent_model`): a random
tiny model never writes a tool call, nor stops before its token limit."""

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
from tests.framework_agents import CALL, langchain_agent, sdk_agent, sdk_streamed_agent
from tests.reference import reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

SAMPLING = SamplingSettings(seed=7, ignore_eos=True)  # no early stop: every reply has text
_ids = itertools.count()


class EngineSampler:
    """The run's part, reduced: one engine request per turn; keeps what the engine returned."""

    def __init__(self, engine, sampling: SamplingSettings = SAMPLING) -> None:
        self.engine = engine
        self.sampling = sampling
        self.turns: list[tuple[list[int], list[int], list[float]]] = []  # (prompt, tokens, logprobs)

    async def __call__(self, prompt: list[int], max_new: int) -> SampledTurn:
        sampling = msgspec.structs.replace(self.sampling, max_tokens=max_new)
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


# -- agent frameworks: the OpenAI Agents SDK and LangChain ---------------------------------------------
# Greedy: the tuned model's most likely reply is the call (sampled at temperature 1, a token of it may
# go astray); it stops on the stop token. The logprobs are the model's own, as at any temperature.
TOOL_SAMPLING = SamplingSettings(temperature=0.0, seed=7)


@pytest.fixture(scope="module")
def tool_model(tool_agent_dir):
    return tool_agent_dir


@pytest.fixture(scope="module")
async def tool_engine(tool_model):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine

    engine = InProcessEngine(EngineConfig(model=str(tool_model), kind="inproc"), "inproc-tools")
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.mark.parametrize("agent", [sdk_agent, sdk_streamed_agent, langchain_agent])
async def test_a_framework_agent_on_the_engine_records_exactly_what_the_engine_sampled(tool_engine, tool_model,
                                                                                        agent, tmp_path):
    renderer = TurnRenderer(AutoTokenizer.from_pretrained(tool_model))
    endpoint = AgentEndpoint(renderer, token="t", sampling_check=sampling_checker(TOOL_SAMPLING))
    sampler = EngineSampler(tool_engine, TOOL_SAMPLING)
    async with served(endpoint, tmp_path) as url:
        ep = await AgentEpisodes(agent, endpoint, lambda: url, timeout_s=300).run_episode({}, sampler, 64)
    # the engine called the tool, the agent ran it and sent its output, the engine answered
    assert [m for m in ep.messages if m["role"] != "system"][1:] == [
        {"role": "assistant", "content": CALL}, {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    assert (ep.turns, ep.reward) == (2, 1.0)
    assert [t for t, s in zip(ep.tokens, ep.sampled) if s] == sum((ids for _, ids, _ in sampler.turns), [])
    assert ep.logprobs == sum((lps for _, _, lps in sampler.turns), [])
    assert ep.prompt_ids == sampler.turns[0][0]
    for k, (prompt, ids, logprobs) in enumerate(sampler.turns):
        assert ep.next_prompt()[:len(prompt) + len(ids)] == prompt + ids, f"turn {k + 1}"
        expected = reference_logprobs(str(tool_model), prompt, ids)
        assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-3, f"turn {k + 1}"
