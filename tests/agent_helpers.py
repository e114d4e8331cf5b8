"""What the agent endpoint's tests share: the endpoint served as the run serves its HTTP app
(`orchestrator.observe.http.HttpServer`: uvicorn on 127.0.0.1, port 0), and a scripted sampler that
records every prompt it is sent."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import anyio
import openai

from orchestrator.tasks.agent_endpoint import EPISODE_HEADER, AgentEndpoint
from orchestrator.tasks.env import SampledTurn

LOGPROB = -0.5
TOKEN = "secret-token"


@contextlib.asynccontextmanager
async def served(endpoint: AgentEndpoint, run_dir: Path):
    """The endpoint's routes on a live server; yields its base URL (no /v1)."""
    from starlette.applications import Starlette

    from orchestrator.observe.http import HttpServer
    from orchestrator.tasks.token_route import served_routes

    run_dir.mkdir(parents=True, exist_ok=True)
    server = HttpServer(Starlette(routes=served_routes(endpoint)), "127.0.0.1", 0, run_dir)
    sock = server.bind()
    # A plain task, not a task group: a fixture's setup and teardown run in different tasks.
    task = asyncio.get_running_loop().create_task(server.serve(sock))
    try:
        yield server.url
    finally:
        server.stop()
        await task


@contextlib.asynccontextmanager
async def served_checking_defaults(renderer, run_dir: Path):
    """(endpoint, base URL) of a served endpoint whose sampling check is the run's defaults."""
    from orchestrator.tasks.agent import sampling_checker
    from replay.records import SamplingSettings

    endpoint = AgentEndpoint(renderer, token=TOKEN, sampling_check=sampling_checker(SamplingSettings()))
    async with served(endpoint, run_dir) as url:
        yield endpoint, url


class Script:
    """A sampler replying with each text in turn (tokenized, plus the stop token when `stop`;
    `chars`: a token per character);
    every turn at `versions[i]` (default 0). `prompts`: what each turn was sent."""

    def __init__(self, renderer, replies, *, versions=None, stop: bool = True, gate: anyio.Event | None = None,
                 chars: bool = False):
        self.r, self.replies, self.stop, self.gate, self.chars = renderer, list(replies), stop, gate, chars
        self.versions = list(versions) if versions is not None else [0] * len(self.replies)
        self.prompts: list[list[int]] = []
        self.max_new: list[int] = []
        self.replied: list[list[int]] = []

    async def __call__(self, prompt, max_new):
        self.prompts.append(list(prompt))
        self.max_new.append(max_new)
        if self.gate is not None:
            await self.gate.wait()
        text = self.replies.pop(0)
        # chars: one token per character, as a model may sample (not how the tokenizer splits it)
        ids = (sum((self.r.encode(c) for c in text), []) if self.chars else self.r.encode(text))[:max_new]
        finish = "length" if len(ids) == max_new else "stop"
        if self.stop and finish == "stop":
            ids.append(self.r.eos_id)
        self.replied.append(ids)
        return SampledTurn(ids, [LOGPROB] * len(ids), [(0, self.versions.pop(0))], finish)


def client(url: str, episode_id: str | None, token: str = TOKEN) -> openai.AsyncOpenAI:
    headers = {EPISODE_HEADER: episode_id} if episode_id is not None else {}
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=token, default_headers=headers, max_retries=0)


async def chat(c: openai.AsyncOpenAI, messages: list[dict], **kwargs):
    return await c.chat.completions.create(model="any-name", messages=messages, **kwargs)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}
