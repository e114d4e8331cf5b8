"""The generate route (orchestrator/tasks/token_route.py: token in, token out), served by uvicorn
on 127.0.0.1 with a scripted sampler in place of the engine, driven over raw HTTP in the shape
verifiers 0.4's `renderers.client.generate` sends (the client itself, on a real engine:
tests/integration/test_verifiers04.py). Each episode must hold exactly the ids its calls sent and
the sampler returned: the first call's ids its prompt, each later call's new tail environment
tokens."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from orchestrator.tasks.agent_endpoint import EPISODE_HEADER
from orchestrator.tasks.turns import TurnRenderer
from tests.agent_helpers import LOGPROB, TOKEN, Script, served_checking_defaults, user

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return TurnRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture
async def live(renderer, tmp_path):
    """(endpoint, base URL, raw client with the token) of a served endpoint."""
    async with served_checking_defaults(renderer, tmp_path) as (endpoint, url), \
            httpx.AsyncClient(base_url=url, headers=AUTH) as raw:
        yield endpoint, url, raw


def as_verifiers(token_ids, renderer, **sampling):
    """The body `renderers.client.generate` (verifiers 0.4's TrainClient) posts."""
    sp = {"temperature": 1.0, "max_tokens": 8, **sampling, "stop_token_ids": [renderer.eos_id], "logprobs": 1,
          "skip_special_tokens": False}
    return {"model": "tiny", "token_ids": list(token_ids), "sampling_params": sp}


async def generate(raw, episode_id, body, *, path=True):
    if path:
        return await raw.post(f"/e/{episode_id}/inference/v1/generate", json=body)
    return await raw.post("/inference/v1/generate", json=body, headers={EPISODE_HEADER: episode_id})


async def test_three_calls_make_an_episode_of_exactly_the_ids_sent_and_sampled(live, renderer):
    endpoint, _, raw = live
    sampler = Script(renderer, ["12", "3", "45"], versions=[0, 1, 1])
    eid = endpoint.open_episode({"n": 1}, sampler, 16)
    prompt = renderer.first_prompt([user("Digits:")])
    tails = [renderer.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"), []]
    sent, replies = [prompt], []
    for k in range(3):
        r = await generate(raw, eid, as_verifiers(sent[-1], renderer), path=k != 1)  # the path, then the header
        assert r.status_code == 200, r.text
        replies.append(r.json())
        if k < 2:
            sent.append(sent[-1] + r.json()["choices"][0]["token_ids"] + tails[k])
    assert sampler.prompts == sent, "each turn's prompt is exactly the ids the call sent"
    for reply, ids in zip(replies, sampler.replied):
        choice = reply["choices"][0]
        assert choice["token_ids"] == ids and choice["finish_reason"] == "stop"
        assert choice["logprobs"]["content"] == [{"token": f"token_id:{t}", "token_id": t, "logprob": LOGPROB}
                                                 for t in ids], "the shape renderers.client reads"
    assert replies[2]["prompt_token_ids"] == sent[2]
    assert replies[2]["usage"] == {"prompt_tokens": len(sent[2]), "completion_tokens": len(sampler.replied[2]),
                                   "total_tokens": len(sent[2]) + len(sampler.replied[2])}
    ep = endpoint.close_episode(eid)
    assert ep.prompt_ids == prompt and ep.turns == 3 and ep.messages == []
    assert ep.next_prompt() == sent[2] + sampler.replied[2], "token-exact: the ids sent, then the ids sampled"
    sampled = [t for t, s in zip(ep.tokens, ep.sampled) if s]
    assert sampled == sum(sampler.replied, []) and ep.logprobs == [LOGPROB] * len(sampled)
    start = len(sampler.replied[0])
    assert ep.spans == [(start, start + len(tails[0]))], "the tail a call adds is the environment's, not trained on"
    assert ep.changes == [(0, 0), (start + len(tails[0]), 1)]


async def test_a_call_that_does_not_extend_the_episode_is_400_naming_the_first_index(live, renderer):
    endpoint, _, raw = live
    sampler = Script(renderer, ["12", "3"])
    eid = endpoint.open_episode({}, sampler, 16)
    prompt = renderer.first_prompt([user("Digits:")])
    first = (await generate(raw, eid, as_verifiers(prompt, renderer))).json()["choices"][0]["token_ids"]
    so_far = prompt + first
    rewritten = list(so_far) + [7]
    rewritten[len(prompt) + 1] = (rewritten[len(prompt) + 1] + 1) % len(renderer.tokenizer)  # a sampled id changed
    cases = {f"token_ids[{len(prompt) + 1}]": rewritten,
             f"token_ids[{len(so_far) - 1}]": so_far[:-1]}  # the last sampled id missing
    for name, ids in cases.items():
        r = await generate(raw, eid, as_verifiers(ids, renderer))
        assert (r.status_code, r.json()["error"]["param"]) == (400, name), r.text
    # refused calls changed nothing: the next good call extends the episode as if they never came
    r = await generate(raw, eid, as_verifiers(so_far + [7, 8], renderer))
    assert r.status_code == 200, r.text
    ep = endpoint.close_episode(eid)
    assert sampler.prompts[1] == so_far + [7, 8] and ep.spans == [(len(first), len(first) + 2)]
    assert ep.next_prompt() == so_far + [7, 8] + sampler.replied[1]


async def test_sampling_other_than_the_runs_is_refused_naming_the_field(live, renderer):
    endpoint, _, raw = live
    sampler = Script(renderer, ["1 2 3 4 5 6 7 8 9"], stop=False)
    eid = endpoint.open_episode({}, sampler, 4)
    prompt = renderer.first_prompt([user("hi")])
    refused = {"sampling_params.temperature": {"temperature": 0.5},
               "sampling_params.top_k": {"top_k": 5},
               "sampling_params.seed": {"seed": 3},
               "sampling_params.stop_token_ids": {"stop_token_ids": [renderer.eos_id, 7]},
               "sampling_params.logprobs": {"logprobs": 5},
               "sampling_params.n": {"n": 2},
               "sampling_params.max_tokens": {"max_tokens": 0},
               "sampling_params.structured_outputs": {"structured_outputs": {"regex": "[0-9]+"}}}
    for name, change in refused.items():
        body = as_verifiers(prompt, renderer)
        body["sampling_params"].update(change)
        r = await generate(raw, eid, body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, name), r.text
    for field, value in [("features", {}), ("stream", True), ("output_mode", "text")]:
        r = await generate(raw, eid, {**as_verifiers(prompt, renderer), field: value})
        assert (r.status_code, r.json()["error"]["param"]) == (400, field), r.text
    for ids, name in [([], "token_ids"), ([1, len(renderer.tokenizer)], "token_ids[1]"), ([1, -2], "token_ids[1]")]:
        r = await generate(raw, eid, as_verifiers(ids, renderer))
        assert (r.status_code, r.json()["error"]["param"]) == (400, name), r.text
    assert endpoint._open[eid].episode is None, "no refused call opened the episode"
    # the run's own settings, repeated, and fields that change only how a reply is shown, are fine;
    # max_tokens is capped by the run's per-turn limit
    body = as_verifiers(prompt, renderer, top_p=1.0, top_k=-1, max_tokens=50, routed_experts_prompt_start=3)
    r = await generate(raw, eid, {**body, "cache_salt": "s", "request_id": "mine"})
    assert r.status_code == 200, r.text
    assert sampler.max_new == [4] and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["request_id"] == "mine"


async def test_a_token_episode_is_one_kind_and_the_route_needs_the_token(live, renderer):
    endpoint, url, raw = live
    eid = endpoint.open_episode({}, Script(renderer, ["1"]), 8)
    prompt = renderer.first_prompt([user("hi")])
    async with httpx.AsyncClient(base_url=url) as no_token:
        r = await no_token.post(f"/e/{eid}/inference/v1/generate", json=as_verifiers(prompt, renderer))
    assert (r.status_code, r.json()["error"]["param"]) == (401, "Authorization")
    r = await generate(raw, "nope", as_verifiers(prompt, renderer))
    assert (r.status_code, r.json()["error"]["param"]) == (404, "episode")
    r = await raw.post(f"/e/{eid}/inference/v1/generate", json={**as_verifiers(prompt, renderer), "episode": "x"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "episode"), "the path and the body disagree"
    assert (await generate(raw, eid, as_verifiers(prompt, renderer))).status_code == 200
    r = await raw.post("/v1/chat/completions", json={"messages": [user("hi")]}, headers={EPISODE_HEADER: eid})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "episode"), "a tokens episode is not a chat"
    assert endpoint.close_episode(eid).turns == 1
