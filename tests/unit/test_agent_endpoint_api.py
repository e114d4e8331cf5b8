"""The agent endpoint's other ways in (issue #33, docs/agents.md): the episode named by the URL,
streamed replies (chat, completions, responses) and the Responses API, driven by the real `openai`
client, the OpenAI Agents SDK and LangChain against a scripted sampler (the engine's part:
tests/integration/test_agent_engine.py). A streamed episode must be exactly the unstreamed one."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from orchestrator.tasks.agent import AgentEpisodes
from orchestrator.tasks.agent_endpoint import EPISODE_HEADER
from orchestrator.tasks.turns import TurnRenderer
from tests.agent_helpers import LOGPROB, TOKEN, Script, assistant, chat, client, served_checking_defaults, user
from tests.framework_agents import CALL, INSTRUCTIONS, QUESTION, langchain_agent, sdk_agent, sdk_streamed_agent

ADD = {"type": "function", "name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
CHAT_ADD = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
TEXT = "héllo 你好 7"  # characters of several bytes: some tokens carry no whole character


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return TurnRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture
async def live(renderer, tmp_path):
    async with served_checking_defaults(renderer, tmp_path) as live:
        yield live


def at(url: str, eid: str, **headers) -> openai.AsyncOpenAI:
    """A client that knows only a base URL naming the episode, and the key."""
    return openai.AsyncOpenAI(base_url=f"{url}/e/{eid}/v1", api_key=TOKEN, default_headers=headers, max_retries=0)


def same_episode(a, b) -> None:
    for name in ("prompt_ids", "tokens", "sampled", "logprobs", "changes", "messages", "turns"):
        assert getattr(a, name) == getattr(b, name), name


# -- the episode in the URL ------------------------------------------------------------------------
async def test_the_url_names_the_episode_and_any_two_names_must_agree(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["1", "2"])
    eid = endpoint.open_episode({}, sampler, 8)
    c = at(url, eid)
    assert [m.id for m in (await c.models.list()).data] == ["inflight"]
    r = await chat(c, [user("hi")])
    await chat(at(url, eid, **{EPISODE_HEADER: eid}), [user("hi"), assistant(r.choices[0].message.content),
                                                       user("more")], extra_body={"episode": eid})
    assert endpoint._open[eid].episode.turns == 2
    for other, name in [(at(url, eid, **{EPISODE_HEADER: "other"}), "the header"),
                        (client(url, "other"), "the body field")]:
        kwargs = {"extra_body": {"episode": eid}} if name == "the body field" else {}
        with pytest.raises(openai.BadRequestError, match="name different episodes") as refused:
            await chat(other, [user("x")], **kwargs)
        assert refused.value.body["param"] == "episode" and name in refused.value.body["message"]
    with pytest.raises(openai.NotFoundError, match="nope"):
        await chat(at(url, "nope"), [user("hi")])
    assert endpoint.close_episode(eid).turns == 2


async def test_an_agent_client_built_from_the_base_url_and_key_alone_lands_in_its_episode(live, renderer):
    endpoint, url = live
    seen = []

    async def run(given, row):
        seen.append(str(given.base_url))
        bare = openai.AsyncOpenAI(base_url=str(given.base_url), api_key=given.api_key, max_retries=0)
        await chat(bare, [user("hi")])
        return 1.0

    ep = await AgentEpisodes(run, endpoint, lambda: url, timeout_s=30).run_episode({}, Script(renderer, ["1"]), 8)
    assert ep.turns == 1 and seen[0].startswith(f"{url}/e/") and seen[0].rstrip("/").endswith("/v1")


# -- streaming: chat and completions -----------------------------------------------------------------
async def test_a_streamed_chat_reply_is_a_chunk_per_token_and_records_the_unstreamed_episode(live, renderer):
    endpoint, url = live
    episodes = []
    for stream in (True, False):
        sampler = Script(renderer, [TEXT, "2"])
        eid = endpoint.open_episode({}, sampler, 32)
        c = at(url, eid)
        if stream:
            chunks = [x async for x in await chat(c, [user("hi")], stream=True, logprobs=True,
                                                  stream_options={"include_usage": True})]
            assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
            body = [x.choices[0] for x in chunks[1:-1]]
            content = "".join(ch.delta.content or "" for ch in body)
            assert content == TEXT and body[-1].finish_reason == "stop"
            assert [ch.logprobs.content[0].logprob for ch in body[:-1]] == [LOGPROB] * len(sampler.replied[0])
            assert body[-1].model_extra["token_ids"] == sampler.replied[0]
            assert chunks[-1].usage.prompt_tokens == len(sampler.prompts[0])
            assert chunks[-1].usage.completion_tokens == len(sampler.replied[0])
        else:
            content = (await chat(c, [user("hi")])).choices[0].message.content
        await chat(c, [user("hi"), assistant(content), user("more")], stream=stream)
        episodes.append(endpoint.close_episode(eid))
    same_episode(*episodes)


async def test_a_streamed_tool_call_comes_as_openai_streams_it(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["Let me add. " + CALL, "3"])
    eid = endpoint.open_episode({}, sampler, 64)
    c = at(url, eid)
    chunks = [x.choices[0] async for x in await chat(c, [user("1 + 2?")], tools=[CHAT_ADD], stream=True)]
    assert "".join(ch.delta.content or "" for ch in chunks) == "Let me add."
    calls = [call for ch in chunks for call in ch.delta.tool_calls or []]
    assert [(d.index, d.id, d.type, d.function.name) for d in calls[:1]] == [(0, "call_1_0", "function", "add")]
    assert "".join(d.function.arguments for d in calls) == '{"a": 1, "b": 2}'
    assert chunks[-1].finish_reason == "tool_calls"
    echoed = {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    await chat(c, [user("1 + 2?"), echoed, {"role": "tool", "tool_call_id": "call_1_0", "content": "3"}],
               tools=[CHAT_ADD])
    assert endpoint.close_episode(eid).turns == 2


async def test_a_streamed_completion_joins_to_the_text_and_records_the_same_episode(live, renderer):
    endpoint, url = live
    episodes = []
    for stream in (True, False):
        sampler = Script(renderer, [" " + TEXT, " 3"], stop=False)
        eid = endpoint.open_episode({}, sampler, 32)
        c = at(url, eid)
        if stream:
            chunks = [x.choices[0] async for x in await c.completions.create(model="m", prompt="Say:", stream=True,
                                                                           logprobs=0)]
            text = "".join(ch.text for ch in chunks)
            assert text == " " + TEXT and chunks[-1].finish_reason == "stop"
            assert [ch.logprobs.token_logprobs[0] for ch in chunks[:-1]] == [LOGPROB] * len(sampler.replied[0])
        else:
            text = (await c.completions.create(model="m", prompt="Say:")).choices[0].text
        await c.completions.create(model="m", prompt="Say:" + text + " and", stream=stream)
        episodes.append(endpoint.close_episode(eid))
    same_episode(*episodes)


async def test_a_client_that_leaves_mid_stream_leaves_the_episode_free_for_its_next_call(live, renderer):
    endpoint, url = live
    eid = endpoint.open_episode({}, Script(renderer, [TEXT, "2"]), 32)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(headers=headers) as raw:
        async with raw.stream("POST", f"{url}/e/{eid}/v1/chat/completions",
                              json={"messages": [user("hi")], "stream": True}) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            async for line in streamed.aiter_lines():
                assert line.startswith("data: {")
                break  # and leave
        events = (await raw.post(f"{url}/e/{eid}/v1/chat/completions", json={
            "messages": [user("hi"), assistant(TEXT), user("more")], "stream": True})).text
    assert events.rstrip().endswith("data: [DONE]")
    assert not endpoint._open[eid].busy and endpoint.close_episode(eid).turns == 2


# -- the Responses API ---------------------------------------------------------------------------
async def test_responses_map_messages_function_calls_and_their_outputs_onto_the_episode(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["Let me add. " + CALL, "3"])
    eid = endpoint.open_episode({}, sampler, 64)
    c = at(url, eid)
    first = await c.responses.create(model="m", instructions="You add.", input="1 + 2?", tools=[ADD], store=True)
    assert first.status == "completed" and [o.type for o in first.output] == ["message", "function_call"]
    message, call = first.output
    assert message.content[0].text == "Let me add." and (call.name, call.arguments) == ("add", '{"a": 1, "b": 2}')
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(sampler.prompts[0]), len(sampler.replied[0]))
    given = [{"role": "user", "content": [{"type": "input_text", "text": "1 + 2?"}]},
             *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "3"}]
    second = await c.responses.create(model="m", instructions="You add.", input=given, tools=[ADD])
    assert second.output_text == "3" and [o.type for o in second.output] == ["message"]
    ep = endpoint.close_episode(eid)
    assert ep.messages[0]["role"] == "system" and ep.messages[0]["content"].startswith("You add.\n\n")
    assert '"name": "add"' in ep.messages[0]["content"], "the tools, described as for chat"
    assert ep.messages[1:] == [user("1 + 2?"), assistant("Let me add. " + CALL), {"role": "tool", "content": "3"},
                               assistant("3")]
    delta = renderer.delta(ep.messages[:3], sampler.replied[0], [{"role": "tool", "content": "3"}])
    assert sampler.prompts[1] == sampler.prompts[0] + sampler.replied[0] + delta


async def test_a_responses_call_that_rewrites_an_item_is_400_naming_it(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["Let me add. " + CALL, "3"])
    eid = endpoint.open_episode({}, sampler, 64)
    c = at(url, eid)
    first = await c.responses.create(model="m", input=[user("1 + 2?")], tools=[ADD])
    message, call = (o.model_dump(exclude_none=True) for o in first.output)
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "3"}
    cases = {"input[0]": [user("1 + 3?"), message, call, answer],
             "input[1]": [user("1 + 2?"), {**message, "content": [{"type": "output_text", "text": "No."}]}, call,
                          answer],
             "input[2]": [user("1 + 2?"), message, {**call, "arguments": '{"a": 1, "b": 3}'}, answer],
             "input[3].call_id": [user("1 + 2?"), message, call, {**answer, "call_id": "call_9"}],
             "input": [user("1 + 2?")],
             "input[1].type": [user("1 + 2?"), {"type": "reasoning", "summary": []}]}
    for name, given in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            await c.responses.create(model="m", input=given, tools=[ADD])
        assert refused.value.body["param"] == name, (name, refused.value.body)
    for kwargs, name in [({"previous_response_id": first.id}, "previous_response_id"),
                         ({"conversation": "conv_1"}, "conversation"), ({"background": True}, "background"),
                         ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                         ({"include": ["reasoning.encrypted_content"]}, "include"),
                         ({"temperature": 0.3}, "temperature"), ({"tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as refused:
            await c.responses.create(model="m", input=[user("1 + 2?"), message, call, answer],
                                     **{"tools": [ADD], **kwargs})
        assert refused.value.body["param"] == name, (name, refused.value.body)
    second = await c.responses.create(model="m", input=[user("1 + 2?"), message, call, answer], tools=[ADD])
    assert second.output_text == "3" and endpoint.close_episode(eid).turns == 2, "refused calls changed nothing"


async def test_a_response_cut_by_its_length_is_incomplete_and_carries_logprobs_when_included(live, renderer):
    endpoint, url = live
    eid = endpoint.open_episode({}, Script(renderer, ["1 2 3 4 5 6"], stop=False), 64)
    r = await at(url, eid).responses.create(model="m", input="count", max_output_tokens=3,
                                            include=["message.output_text.logprobs"])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and [x.logprob for x in r.output[0].content[0].logprobs] == [LOGPROB] * 3


async def test_each_logprob_names_its_token_as_the_tokenizer_decodes_it_alone(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, [TEXT])  # characters of several bytes: tokens that hold a part of one
    eid = endpoint.open_episode({}, sampler, 64)
    reply = await at(url, eid).chat.completions.create(model="m", messages=[user("hi")], logprobs=True)
    items = reply.choices[0].logprobs.content
    expected = [renderer.tokenizer.decode([t], skip_special_tokens=False) for t in sampler.replied[0]]
    assert [x.token for x in items] == expected and "\ufffd" in expected
    assert [x.bytes for x in items] == [list(t.encode()) for t in expected]


async def test_a_streamed_response_sends_the_events_the_agents_sdk_reads(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, [TEXT, "Let me add. " + CALL])
    eid = endpoint.open_episode({}, sampler, 64)
    c = at(url, eid)
    events = [e async for e in await c.responses.create(model="m", input="hi", tools=[ADD], stream=True)]
    text = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", *text[:2], *["response.output_text.delta"] *
                     len(deltas), *text[3:], "response.completed"]
    # a delta per token that adds text (no logprobs asked: a byte of a character adds none)
    assert "".join(deltas) == TEXT and all(deltas) and 1 < len(deltas) < len(sampler.replied[0])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == TEXT and done.usage.output_tokens == len(sampler.replied[0])
    given = [user("hi"), *[o.model_dump(exclude_none=True) for o in done.output], user("add")]
    events = [e async for e in await c.responses.create(model="m", input=given, tools=[ADD], stream=True)]
    kinds = [e.type for e in events]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert [o.type for o in events[-1].response.output] == ["message", "function_call"]
    assert events[-3].arguments == '{"a": 1, "b": 2}' and events[-3].item_id == events[-1].response.output[1].id
    assert endpoint.close_episode(eid).turns == 2


# -- agent frameworks, unchanged but for their base URL and key -------------------------------------
@pytest.mark.parametrize("agent", [sdk_agent, sdk_streamed_agent, langchain_agent])
async def test_a_framework_agent_calls_its_tool_and_its_episode_is_exactly_the_sampled_turns(live, renderer,
                                                                                           agent):
    endpoint, url = live
    sampler = Script(renderer, [CALL, "It is 3"])
    ep = await AgentEpisodes(agent, endpoint, lambda: url, timeout_s=60).run_episode({}, sampler, 64)
    assert (ep.turns, ep.reward) == (2, 1.0)
    assert ep.messages[0]["content"].startswith(INSTRUCTIONS) and ep.messages[1] == user(QUESTION)
    assert ep.messages[2:] == [assistant(CALL), {"role": "tool", "content": "3"}, assistant("It is 3")]
    assert ep.prompt_ids == sampler.prompts[0]
    delta = renderer.delta(ep.messages[:3], sampler.replied[0], [{"role": "tool", "content": "3"}])
    assert sampler.prompts[1] == sampler.prompts[0] + sampler.replied[0] + delta
    assert [t for t, s in zip(ep.tokens, ep.sampled) if s] == sum(sampler.replied, [])

