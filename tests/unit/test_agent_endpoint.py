"""The agent endpoint (orchestrator/tasks/agent_endpoint.py), the agent runner (tasks/agent.py) and the
verifiers adapter (tasks/verifiers.py), served by uvicorn on 127.0.0.1 and driven by the real
`openai` client, with a scripted sampler in place of the engine (the engine's part:
tests/integration/test_agent_engine.py). Each episode's tokens must be exactly what the sampler
was sent, turn by turn: the first prompt rendered once, each later one the episode so far plus
the template's delta for the new messages."""

from __future__ import annotations

import signal
import sys
import threading
import types

import anyio
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from orchestrator.tasks.agent_endpoint import EPISODE_HEADER, AgentEndpoint
from orchestrator.errors import ConfigError
from orchestrator.tasks.agent import AgentEpisodes, AgentError, AgentTimeout, sampling_checker
from orchestrator.tasks.env import DONE, MAX_EPISODE_TOKENS, Environment, run_episode
from orchestrator.tasks.turns import TurnRenderer
from orchestrator.tasks.user_code import UserCode
from replay.records import SamplingSettings
from tests.agent_helpers import LOGPROB, TOKEN, Script, assistant, chat, client, served, served_checking_defaults, user

@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return TurnRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture
async def live(renderer, tmp_path):
    """(endpoint, base URL) of a served endpoint checking sampling against the defaults."""
    async with served_checking_defaults(renderer, tmp_path) as live:
        yield live


# -- token in, token out ---------------------------------------------------------------------------
async def test_a_three_turn_episode_holds_exactly_the_tokens_its_calls_sent_and_sampled(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["7", "77", "7"], versions=[1, 1, 2])
    eid = endpoint.open_episode({"n": 7}, sampler, 16)
    c, messages, replies = client(url, eid), [user("Say 7.")], []
    for k in range(3):
        r = await chat(c, messages, logprobs=True)
        replies.append(r.choices[0].message.content)
        assert r.usage.prompt_tokens == len(sampler.prompts[k])
        assert [i.logprob for i in r.choices[0].logprobs.content] == [LOGPROB] * len(sampler.replied[k])
        assert r.choices[0].model_extra["token_ids"] == sampler.replied[k]
        messages += [assistant(replies[-1]), user(f"Again ({k}).")]
    assert replies == ["7", "77", "7"] and r.choices[0].finish_reason == "stop"
    ep = endpoint.close_episode(eid)
    # turn 1: the template's rendering; turn k+1: turn k's prompt + its reply + the delta
    assert sampler.prompts[0] == renderer.first_prompt([user("Say 7.")]) == ep.prompt_ids
    for k in (1, 2):
        history = [user("Say 7.")] + [m for j in range(k - 1) for m in (assistant(replies[j]), user(f"Again ({j})."))]
        delta = renderer.delta(history, sampler.replied[k - 1], [user(f"Again ({k - 1}).")])
        assert sampler.prompts[k] == sampler.prompts[k - 1] + sampler.replied[k - 1] + delta
    assert ep.next_prompt() == sampler.prompts[2] + sampler.replied[2]
    sampled = [t for t, s in zip(ep.tokens, ep.sampled) if s]
    assert sampled == sum(sampler.replied, []) and ep.logprobs == [LOGPROB] * len(sampled)
    third = [i for i, s in enumerate(ep.sampled) if s][len(sampler.replied[0]) + len(sampler.replied[1])]
    assert ep.changes == [(0, 1), (third, 2)] and ep.turns == 3
    # the same episode as the environment runner makes of the same conversation
    same = await run_episode(_Replay(), renderer, Script(renderer, ["7", "77", "7"], versions=[1, 1, 2]),
                             {"n": 7}, 16)
    for name in ("prompt_ids", "tokens", "sampled", "logprobs", "changes", "messages", "turns"):
        assert getattr(ep, name) == getattr(same, name), name


async def test_a_reply_sampled_as_other_tokens_than_the_tokenizer_would_write_is_never_retokenized(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["ab", "c"], chars=True)  # the tokenizer writes "ab" as one token
    eid = endpoint.open_episode({}, sampler, 8)
    c = client(url, eid)
    await chat(c, [user("hi")])
    await chat(c, [user("hi"), assistant("ab"), user("more")])
    ep = endpoint.close_episode(eid)
    assert sampler.prompts[1] == sampler.prompts[0] + sampler.replied[0] + renderer.delta(
        [user("hi")], sampler.replied[0], [user("more")])
    rendered = renderer.first_prompt([user("hi"), assistant("ab"), user("more")])
    assert rendered != sampler.prompts[1], "rendering the conversation again would change the sampled tokens"
    assert ep.tokens[:len(sampler.replied[0])] == renderer.encode("a") + renderer.encode("b") + [renderer.eos_id]


class _Replay(Environment):
    max_turns = 3

    async def reset(self, row):
        return [user("Say 7.")]

    async def step(self, episode):
        return [user(f"Again ({episode.turns - 1}).")], None, False


async def test_the_reply_names_the_model_and_models_lists_one(live, renderer):
    endpoint, url = live
    models = await client(url, None).models.list()
    assert [m.id for m in models.data] == ["inflight"]
    eid = endpoint.open_episode({}, Script(renderer, ["1 2 3 4 5 6"], stop=False), 3)
    r = await chat(client(url, eid), [user("hi")], max_tokens=50)
    assert r.model == "any-name" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3, "max_tokens is capped by the run's max_tokens_per_turn"


# -- what is refused -------------------------------------------------------------------------------
async def test_a_wrong_or_missing_token_is_401(live, renderer):
    endpoint, url = live
    eid = endpoint.open_episode({}, Script(renderer, ["1"]), 8)
    with pytest.raises(openai.AuthenticationError, match="Authorization"):
        await chat(client(url, eid, token="wrong"), [user("hi")])
    async with httpx.AsyncClient(headers={EPISODE_HEADER: eid}) as raw:  # no token at all
        for r in (await raw.get(url + "/v1/models"), await raw.post(url + "/v1/chat/completions", json={})):
            assert r.status_code == 401 and r.json()["error"]["param"] == "Authorization"
    assert endpoint.close_episode(eid) is None, "no refused call reached the episode"


async def test_an_unknown_or_closed_episode_is_404_naming_it(live, renderer):
    endpoint, url = live
    with pytest.raises(openai.NotFoundError, match="nope"):
        await chat(client(url, "nope"), [user("hi")])
    eid = endpoint.open_episode({}, Script(renderer, ["1", "2"]), 8)
    await chat(client(url, eid), [user("hi")])
    endpoint.close_episode(eid)
    with pytest.raises(openai.NotFoundError, match=eid):
        await chat(client(url, eid), [user("hi"), assistant("1"), user("more")])
    assert endpoint.close_episode(eid) is None


async def test_a_call_that_does_not_extend_the_conversation_is_400_naming_the_message(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["1", "2"])
    eid = endpoint.open_episode({}, sampler, 8)
    c = client(url, eid)
    await chat(c, [user("hi")])
    cases = {"messages[0]": [user("HI"), assistant("1"), user("x")],  # an earlier turn rewritten
             "messages[1]": [user("hi"), assistant("one"), user("x")],  # the reply not as returned
             "messages[2].role": [user("hi"), assistant("1"), assistant("2")],  # a reply not sampled here
             "messages": [user("hi"), assistant("1")]}  # nothing new
    for name, messages in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            await chat(c, messages)
        assert refused.value.body["param"] == name, refused.value.body
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]: missing"):
        await chat(c, [user("hi")])
    # refused calls changed nothing: the next good call extends the episode as if they never came
    await chat(c, [user("hi"), assistant("1"), user("x")])
    ep = endpoint.close_episode(eid)
    assert sampler.prompts[1] == sampler.prompts[0] + sampler.replied[0] + renderer.delta(
        [user("hi")], sampler.replied[0], [user("x")])
    assert ep.turns == 2 and ep.next_prompt() == sampler.prompts[1] + sampler.replied[1]


async def test_malformed_requests_are_400_naming_the_field(live, renderer):
    endpoint, url = live
    eid = endpoint.open_episode({}, Script(renderer, ["1"]), 8)
    c = client(url, eid)
    for kwargs, name in [({"n": 2}, "n"), ({"extra_body": {"stream": "yes"}}, "stream"),
                         ({"max_tokens": 0}, "max_tokens"),
                         ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
                         ({"tool_choice": "required", "tools": [{"type": "function"}]}, "tool_choice"),
                         ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
                         ({"extra_body": {"episode": "other"}}, "episode")]:
        with pytest.raises(openai.BadRequestError) as refused:
            await chat(c, [user("hi")], **kwargs)
        assert refused.value.body["param"] == name
    for messages, name in [([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
                           ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content")]:
        with pytest.raises(openai.BadRequestError) as refused:
            await chat(c, messages)
        assert refused.value.body["param"] == name
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}", EPISODE_HEADER: eid}) as raw:
        bad_json = await raw.post(url + "/v1/chat/completions", content=b"{not json")
        no_episode = await raw.post(url + "/v1/completions", json={"prompt": "x"}, headers={EPISODE_HEADER: ""})
        by_body = await raw.post(url + "/v1/chat/completions", json={"messages": [user("hi")], "episode": eid},
                                 headers={EPISODE_HEADER: eid})
    assert (bad_json.status_code, bad_json.json()["error"]["param"]) == (400, "body")
    assert no_episode.status_code == 404
    assert by_body.status_code == 200, "the header and the body field may both name the episode"


async def test_two_calls_at_once_on_one_episode_are_409(live, renderer):
    endpoint, url = live
    gate = anyio.Event()
    eid = endpoint.open_episode({}, Script(renderer, ["1"], gate=gate), 8)
    results = {}

    async def first():
        results["first"] = await chat(client(url, eid), [user("hi")])

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        while endpoint._open[eid].episode is None:  # the first call is in the sampler
            await anyio.sleep(0.01)
        with pytest.raises(openai.ConflictError, match="in flight"):
            await chat(client(url, eid), [user("hi")])
        gate.set()
    assert results["first"].choices[0].message.content == "1"
    assert endpoint.close_episode(eid).turns == 1


async def test_sampling_parameters_other_than_the_runs_are_refused_naming_them(live, renderer, tmp_path):
    endpoint, url = live
    eid = endpoint.open_episode({}, Script(renderer, ["1"]), 8)
    c = client(url, eid)
    for kwargs, name in [({"temperature": 0.5}, "temperature"), ({"presence_penalty": 0.5}, "presence_penalty"),
                         ({"extra_body": {"top_k": 5}}, "top_k"), ({"seed": 3}, "seed")]:
        with pytest.raises(openai.BadRequestError) as refused:
            await chat(c, [user("hi")], **kwargs)
        assert refused.value.body["param"] == name and "the run samples with" in refused.value.body["message"]
    r = await chat(c, [user("hi")], temperature=1.0, top_p=1, extra_body={"top_k": 0}, presence_penalty=0,
                   user="agent-1", metadata={"k": "v"}, store=False)
    assert r.choices[0].message.content == "1", "the run's own settings may be repeated, metadata is ignored"
    unchecked = AgentEndpoint(renderer, token=TOKEN)  # no sampling_check: any sampling parameter is refused
    eid = unchecked.open_episode({}, Script(renderer, ["1"]), 8)
    async with served(unchecked, tmp_path / "second") as other:
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await chat(client(other, eid), [user("hi")], temperature=1.0)


def test_the_sampling_checker_compares_with_the_runs_settings():
    check = sampling_checker(SamplingSettings(temperature=0.7, top_k=20, stop=("END",), seed=1))
    check({"temperature": 0.7, "top_k": 20, "stop": "END", "seed": 1, "frequency_penalty": 0.0})
    for body, name in [({"temperature": 1.0}, "temperature"), ({"stop": ["X"]}, "stop"), ({"top_k": -1}, "top_k"),
                       ({"ignore_eos": 1}, "ignore_eos"), ({"reasoning_effort": "low"}, "reasoning_effort")]:
        with pytest.raises(ConfigError) as refused:
            check(body)
        assert refused.value.field == name


async def test_a_budget_of_episode_tokens_caps_each_turn_and_refuses_past_it(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, ["1 2 3 4 5 6 7 8", "1"], stop=False)
    first = len(renderer.first_prompt([user("hi")]))
    eid = endpoint.open_episode({}, sampler, 64, max_episode_tokens=first + 4)
    c = client(url, eid)
    r = await chat(c, [user("hi")])
    assert sampler.max_new == [4] and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="maximum context length is"):
        await chat(c, [user("hi"), assistant(r.choices[0].message.content), user("more")])


async def test_an_engine_failure_is_a_502_and_the_episodes_failure(live, renderer):
    endpoint, url = live

    async def broken(prompt, max_new):
        raise RuntimeError("engine fell over")

    eid = endpoint.open_episode({}, broken, 8)
    with pytest.raises(openai.APIStatusError, match="engine fell over") as failed:
        await chat(client(url, eid), [user("hi")])
    assert failed.value.status_code == 502
    assert isinstance(endpoint.failure(eid), RuntimeError)
    with pytest.raises(openai.ConflictError, match="failed"):
        await chat(client(url, eid), [user("hi")])


async def test_an_unexpected_error_in_a_call_is_a_500_and_the_server_goes_on(renderer, tmp_path):
    class Broken(TurnRenderer):
        def first_prompt(self, messages):
            raise RuntimeError("the template blew up")

    endpoint = AgentEndpoint(Broken(renderer.tokenizer), token=TOKEN)
    eid = endpoint.open_episode({}, Script(renderer, ["1"]), 8)
    async with served(endpoint, tmp_path) as url:
        with pytest.raises(openai.InternalServerError, match="the template blew up"):
            await chat(client(url, eid), [user("hi")])
        assert [m.id for m in (await client(url, None).models.list()).data] == ["inflight"]


async def test_closing_an_episode_cancels_its_call_in_flight(live, renderer):
    endpoint, url = live
    gate = anyio.Event()  # never set: the sampler waits until cancelled
    sampler = Script(renderer, ["1"], gate=gate)
    eid = endpoint.open_episode({}, sampler, 8)
    async with anyio.create_task_group() as tg:
        async def call():
            with pytest.raises(openai.NotFoundError, match="closed during this call"):
                await chat(client(url, eid), [user("hi")])
        tg.start_soon(call)
        while not sampler.prompts:
            await anyio.sleep(0.01)
        ep = endpoint.close_episode(eid)
    assert ep.turns == 0 and ep.tokens == [] and ep.prompt_ids == sampler.prompts[0]


# -- tools and /v1/completions ---------------------------------------------------------------------
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


async def test_tool_calls_are_returned_as_openai_tool_calls_and_answered_by_tool_messages(live, renderer):
    endpoint, url = live
    call = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    sampler = Script(renderer, [call, "3"])
    eid = endpoint.open_episode({}, sampler, 64)
    c = client(url, eid)
    r = await chat(c, [user("1 + 2?")], tools=[ADD])
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me add."
    assert [(t.function.name, t.function.arguments) for t in message.tool_calls] == [("add", '{"a": 1, "b": 2}')]
    # the template of the tiny model renders no tools: they are described in a system message
    first = renderer.tokenizer.decode(sampler.prompts[0])
    assert "<tool_call>" in first and '"name": "add"' in first
    echoed = message.model_dump(exclude_none=True)
    tool = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"}
    with pytest.raises(openai.BadRequestError, match="tools"):
        await chat(c, [user("1 + 2?"), echoed, tool])
    r = await chat(c, [user("1 + 2?"), echoed, tool], tools=[ADD])
    assert r.choices[0].message.content == "3" and r.choices[0].message.tool_calls is None
    ep = endpoint.close_episode(eid)
    assert ep.messages[2] == {"role": "assistant", "content": call}, "the episode keeps the reply as sampled"
    delta = renderer.delta(ep.messages[:2], sampler.replied[0], [{"role": "tool", "content": "3"}])
    assert sampler.prompts[1] == sampler.prompts[0] + sampler.replied[0] + delta


async def test_a_template_that_renders_tools_gets_them_as_tools(renderer, tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + tokenizer.chat_template
    endpoint, sampler = AgentEndpoint(TurnRenderer(tokenizer), token=TOKEN), Script(renderer, ["1"])
    eid = endpoint.open_episode({}, sampler, 8)
    async with served(endpoint, tmp_path) as url:
        await chat(client(url, eid), [user("1 + 2?")], tools=[ADD])
    text = tokenizer.decode(sampler.prompts[0])
    assert text.startswith("<tools>[{") and '"name": "add"' in text and "You may call tools" not in text
    assert endpoint.close_episode(eid).messages[0] == user("1 + 2?"), "no system message was added"


async def test_completions_extend_the_text_so_far_and_tokenize_only_what_a_call_adds(live, renderer):
    endpoint, url = live
    sampler = Script(renderer, [" 1 2", " 3"], stop=False)
    eid = endpoint.open_episode({}, sampler, 2)
    c = client(url, eid)
    r = await c.completions.create(model="m", prompt="Count: 0", logprobs=0)
    assert r.choices[0].logprobs.token_logprobs == [LOGPROB] * len(sampler.replied[0])
    text = "Count: 0" + r.choices[0].text
    with pytest.raises(openai.BadRequestError, match="at character 7"):
        await c.completions.create(model="m", prompt="Count: 9 1 2 and")
    with pytest.raises(openai.BadRequestError, match="one kind per episode"):
        await chat(c, [user("hi")])
    await c.completions.create(model="m", prompt=text + " then")
    ep = endpoint.close_episode(eid)
    assert ep.prompt_ids == list(renderer.tokenizer("Count: 0")["input_ids"]) == sampler.prompts[0]
    env = [t for t, s in zip(ep.tokens, ep.sampled) if not s]
    assert env == renderer.encode(" then") and sampler.prompts[1] == sampler.prompts[0] + sampler.replied[0] + env
    # a completion that stopped on the end-of-sequence token keeps it; its text does not show it
    sampler = Script(renderer, [" 5"])
    eid = endpoint.open_episode({}, sampler, 8)
    r = await client(url, eid).completions.create(model="m", prompt="Count: 4")
    assert r.choices[0].text == " 5" and endpoint.close_episode(eid).tokens == sampler.replied[0]
    assert sampler.replied[0][-1] == renderer.eos_id


# -- agents: run(client, row) ----------------------------------------------------------------------
def agents(endpoint, url, run_fn, timeout_s=30.0):
    return AgentEpisodes(run_fn, endpoint, lambda: url, timeout_s=timeout_s)


async def test_an_agents_episode_is_its_calls_and_its_reward_what_it_returns(live, renderer):
    endpoint, url = live

    async def run(client, row):
        messages = [user(f"Say {row['n']}.")]
        for _ in range(2):
            reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message.content
            messages += [assistant(reply), user("again")]
        return 0.75

    sampler, seen = Script(renderer, ["5", "55"]), []
    ep = await agents(endpoint, url, run).run_episode({"n": 5}, sampler, 16, started=seen.append)
    assert (ep.reward, ep.ended, ep.turns, ep.row) == (0.75, DONE, 2, {"n": 5}) and seen == [ep]
    assert ep.next_prompt() == sampler.prompts[1] + sampler.replied[1]
    assert not endpoint._open, "the episode is closed"

    def sync_run(client, row):  # a plain function gets the sync client
        client.chat.completions.create(model="m", messages=[user("hi")])
        return 1

    ep = await agents(endpoint, url, sync_run).run_episode({}, Script(renderer, ["1"]), 16)
    assert ep.reward == 1.0 and isinstance(ep.reward, float)


async def test_an_agents_episode_refused_for_its_context_length_is_truncated_and_scored(live, renderer):
    endpoint, url = live
    first = len(renderer.first_prompt([user("hi")]))

    async def talks_on(client, row):  # most agents: the 400 raises BadRequestError out of run()
        messages = [user("hi")]
        while True:
            reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message.content
            messages += [assistant(reply), user("more")]

    async def reads_the_refusal(client, row):  # a careful agent scores the cut itself
        try:
            await talks_on(client, row)
        except openai.BadRequestError as exc:
            assert "maximum context length" in str(exc)
            return -0.5

    for run_fn, reward in [(talks_on, 0.25), (reads_the_refusal, -0.5)]:
        runner = AgentEpisodes(run_fn, endpoint, lambda: url, timeout_s=30.0, truncation_reward=0.25)
        sampler = Script(renderer, ["1 2 3 4 5 6 7 8", "1"], stop=False)
        ep = await runner.run_episode({}, sampler, 64, max_len=first + 4)
        assert (ep.ended, ep.truncated, ep.reward, ep.turns) == (MAX_EPISODE_TOKENS, True, reward, 1), run_fn
    assert not endpoint._open

    async def raises_after_a_turn(client, row):  # a failure with room left is the agent's error
        await client.chat.completions.create(model="m", messages=[user("hi")])
        raise KeyError("answer")

    with pytest.raises(AgentError, match="raised KeyError"):
        await AgentEpisodes(raises_after_a_turn, endpoint, lambda: url, timeout_s=30.0).run_episode(
            {}, Script(renderer, ["1"]), 16, max_len=first + 64)


async def test_an_agent_that_fails_returns_no_number_or_never_calls_is_a_named_error(live, renderer):
    endpoint, url = live

    async def call_once(client):
        await client.chat.completions.create(model="m", messages=[user("hi")])

    async def returns_bool(client, row):
        await call_once(client)
        return True

    async def returns_text(client, row):
        await call_once(client)
        return "1.0"

    async def raises(client, row):
        raise KeyError("answer")

    async def never_calls(client, row):
        return 1.0

    for fn, match in [(returns_bool, "returned True"), (returns_text, "returned '1.0'"),
                      (raises, "raised KeyError"), (never_calls, "without calling the endpoint")]:
        with pytest.raises(AgentError, match=match):
            await agents(endpoint, url, fn).run_episode({}, Script(renderer, ["1"]), 16)
    assert not endpoint._open


async def test_an_agent_past_its_timeout_ends_its_episode_and_its_later_calls_get_404(live, renderer):
    endpoint, url = live
    release, statuses = threading.Event(), []

    def slow(client, row):
        client.chat.completions.create(model="m", messages=[user("hi")])
        release.wait(30)
        try:
            client.chat.completions.create(model="m", messages=[user("hi"), assistant("1"), user("more")])
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
        return 1.0

    with pytest.raises(AgentTimeout, match="timeout of 0.5 s") as expired:
        await agents(endpoint, url, slow, timeout_s=0.5).run_episode({}, Script(renderer, ["1", "2"]), 16)
    release.set()
    assert expired.value.where.endswith(" in slow"), "the message says where the agent waited"
    with anyio.fail_after(30):
        while not statuses:
            await anyio.sleep(0.05)
    assert statuses == [404]


async def test_a_hundred_agents_in_flight_each_run_at_once_on_a_runner_of_a_hundred_threads(live, renderer):
    # The run sizes its runner from scheduler.max_inflight (run.py); the pool was 64 threads
    # shared by every agent, so agents 65.. waited for one, their timeout running.
    endpoint, url = live
    n = 100
    all_in = threading.Barrier(n, timeout=60)

    def waits_for_every_other(client, row):
        all_in.wait()  # passes only once n agents run at the same time
        client.chat.completions.create(model="m", messages=[user("hi")])
        return 1.0

    episodes = AgentEpisodes(waits_for_every_other, endpoint, lambda: url, timeout_s=120,
                             user_code=UserCode(threads=n))
    rewards: list[float] = []

    async def one() -> None:
        rewards.append((await episodes.run_episode({}, Script(renderer, ["1"]), 16)).reward)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
    assert rewards == [1.0] * n and not all_in.broken and not endpoint._open


async def test_a_cancelled_agent_episode_is_closed(live, renderer):
    endpoint, url = live
    release = threading.Event()

    def waits(client, row):
        client.chat.completions.create(model="m", messages=[user("hi")])
        release.wait(30)
        return 1.0

    with anyio.move_on_after(0.5) as scope:  # the run cancels the episode (a stop, an abort)
        await agents(endpoint, url, waits).run_episode({}, Script(renderer, ["1"]), 16)
    release.set()
    assert scope.cancelled_caught and not endpoint._open


async def test_an_engine_failure_inside_a_call_is_raised_whatever_the_agent_made_of_it(live, renderer):
    endpoint, url = live

    class Fenced(Exception):
        pass

    async def fenced(prompt, max_new):
        raise Fenced("engine fenced")

    async def shrugs(client, row):
        try:
            await client.chat.completions.create(model="m", messages=[user("hi")])
        except openai.APIStatusError:
            pass
        return 1.0

    with pytest.raises(Fenced, match="engine fenced"):
        await agents(endpoint, url, shrugs).run_episode({}, fenced, 16)


# -- verifiers ---------------------------------------------------------------------------------------
async def test_a_verifiers_multi_turn_environment_is_an_agent_scored_by_its_rubric(live, renderer):
    from orchestrator.tasks.verifiers import make

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    task = make("tests.vf_toy_env", kind="multi", rows=3)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before, "the run's signals"
    assert len(task) == 3 and task.row(1)["prompt"] == [user("Write digits: 1 2")]
    endpoint, url = live
    sampler = Script(renderer, ["1 2", "ab", "12"])
    ep = await agents(endpoint, url, task.run).run_episode(task.row(1), sampler, 16)
    assert ep.turns == 3 and [m["content"] for m in ep.messages if m["role"] == "user"] == [
        "Write digits: 1 2", "again", "again"]
    assert ep.reward == pytest.approx(4 / 6), "the share of digits over the three replies"
    sampled = [t for t, s in zip(ep.tokens, ep.sampled) if s]
    assert sampled == sum(sampler.replied, []) and ep.prompt_ids == sampler.prompts[0]


async def test_verifiers_single_turn_and_tool_environments(live, renderer):
    from orchestrator.tasks.verifiers import make

    endpoint, url = live
    single = make("tests.vf_toy_env", kind="single")
    ep = await agents(endpoint, url, single.run).run_episode(single.row(0), Script(renderer, ["01"]), 16)
    assert (ep.turns, ep.reward) == (1, 1.0)
    tool = make("tests.vf_toy_env", kind="tool")
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 5}}</tool_call>'
    sampler = Script(renderer, [call, "It is 7"])
    ep = await agents(endpoint, url, tool.run).run_episode(tool.row(0), sampler, 64)
    assert (ep.turns, ep.reward) == (2, 1.0) and ep.messages[-2] == {"role": "tool", "content": "7"}


async def test_verifiers_refusals_are_named(live, renderer, monkeypatch):
    from orchestrator.tasks.verifiers import VerifiersError, make

    with pytest.raises(ConfigError, match="group-level reward functions"):
        make("tests.vf_toy_env", kind="group")
    with pytest.raises(ConfigError, match="task.args.env"):
        make("no_such_environment_anywhere")
    newer = types.ModuleType("verifiers")
    newer.__version__ = "0.4.0"  # verifiers.v1 only: no in-process environments
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "verifiers", newer)
        with pytest.raises(ConfigError, match="verifiers 0.4.0 has no in-process environments"):
            make("tests.vf_toy_env")
    endpoint, url = live
    hot = make("tests.vf_toy_env", kind="single")
    hot.sampling_args["temperature"] = 0.3  # the environment asks for other settings than the run's
    with pytest.raises(AgentError, match="VerifiersError.*temperature") as refused:
        await agents(endpoint, url, hot.run).run_episode(hot.row(0), Script(renderer, ["1"]), 16)
    assert isinstance(refused.value.__cause__, VerifiersError), "a refused rollout is an error, never a reward"
