"""An OpenAI-compatible endpoint for agents (issues #19, #33; docs/agents.md): any agent written
against the `openai` client, the OpenAI Agents SDK or LangChain produces episodes with exact tokens,
logprobs and versions.

    POST /v1/chat/completions   POST /v1/completions   POST /v1/responses   GET /v1/models
    and each under /e/{episode}: /e/{episode}/v1/chat/completions, ...
    POST /inference/v1/generate, /e/{episode}/inference/v1/generate   (token in, token out: token_route.py)

Every call needs `Authorization: Bearer <the run's token>` (the openai client's api_key) and
names its episode by the path (`/e/{episode}/v1/...`: a client that knows only a base URL and a
key), the header `X-Inflight-Episode` or the body field `episode`; any of them given must agree
(`_episode_id`). The episode is opened by the run (`open_episode`) and closed by it
(`close_episode`): a call naming an unknown or closed episode is a 404.

Token in, token out: the first call renders its messages with the chat template; a later call
must repeat the episode's conversation so far (the model's replies as returned, compared by role
and content) and add new user / tool / system messages, whose tokens are the template's *delta*
(`turns.TurnRenderer.delta`) appended to the episode's exact tokens: nothing is tokenized twice.
A call that does not extend the conversation is refused (400 naming the first message that
differs). /v1/responses maps its input items onto the same messages (`responses_api.py`).
/v1/completions: the first prompt is tokenized; a later prompt must be the previous prompt +
completion text exactly, and only the text it adds is tokenized.

`stream: true` answers in Server-Sent Events (`agent_stream.py`), sent once the turn is sampled,
joining to exactly the unstreamed reply. Sampling is the run's: `sampling_check(body)` refuses
(ConfigError naming the field) a request whose sampling parameters differ from what the run
samples with, so a record never claims settings that were not used
(`tasks.agent.sampling_checker(settings)` builds one); without a check, any sampling parameter is
refused. n != 1, top logprobs and unknown fields are refused. One call at a time per episode
(409). A bad request is a 4xx naming the field; nothing a client sends stops the run. When the
engine's turn fails (`sample` raises), the call gets 502 and the episode keeps the error
(`failure`), for the run to raise.
"""

from __future__ import annotations

import hmac
import itertools
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from orchestrator.errors import ConfigError
from orchestrator.observe.logging import get_logger
from orchestrator.tasks import agent_stream, responses_api
from orchestrator.tasks.agent_messages import (MODEL_NAME, Refused, chat_messages, chat_tools, error, extension,
                                               finite, reply, split_tool_calls)
from orchestrator.tasks.env import Episode, SampledTurn, Sampler, ToolEnvironment, _reply_text
from orchestrator.tasks.turns import TurnRenderer

__all__ = ["EPISODE_HEADER", "MODEL_NAME", "SAMPLING_FIELDS", "AgentEndpoint", "ChatTurn", "Refused"]

log = get_logger(__name__)

EPISODE_HEADER = "X-Inflight-Episode"
# Fields that do not change what is sampled: accepted and ignored.
_IGNORED = {"model", "episode", "user", "metadata", "store", "parallel_tool_calls", "service_tier",
            "prompt_cache_key", "safety_identifier", "stream_options", "prompt_cache_retention"}
# Fields this module reads itself (per path), beyond the prompt.
_HANDLED = {"max_tokens", "n", "stream", "logprobs"}
_CHAT = _HANDLED | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
_TEXT = _HANDLED | {"prompt", "echo", "suffix"}
# Sampling parameters: what `sampling_check` judges (without one, any of them is refused).
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "best_of", "response_format", "reasoning_effort", "length_penalty"}


@dataclass
class _Conversation:
    """One open episode and what its calls have shown the client."""

    row: dict
    sample: Sampler
    max_tokens_per_turn: int
    max_episode_tokens: int | None
    started: Callable[[Episode], None] | None
    episode: Episode | None = None
    kind: str | None = None  # "chat" (chat completions and responses) or "completion": one kind per episode
    seen: list[dict] = field(default_factory=list)  # chat: the conversation as returned (role, content, calls)
    history: list[dict] = field(default_factory=list)  # Episode.messages before the last reply
    last_ids: list[int] = field(default_factory=list)  # the last turn's sampled ids
    text: str = ""  # completion: prompt + completions so far, as the client sees them
    tools: list | None = None  # chat: the first call's tools; later calls must repeat them
    busy: bool = False
    scope: anyio.CancelScope | None = None
    failure: BaseException | None = None
    closed: bool = False
    # The last call was refused for the context length (max_episode_tokens): the episode is cut
    # there unless a later call that fits samples a turn.
    truncated: bool = False


@dataclass
class ChatTurn:
    """One sampled chat turn as the client is shown it (chat completion or response)."""

    turn: SampledTurn
    prompt_len: int
    content: str  # the reply's text outside its tool calls
    calls: list[dict] | None  # OpenAI `tool_calls`
    number: int  # the episode's turn count after it


class AgentEndpoint:
    """The routes, and the episodes open on them."""

    def __init__(self, renderer: TurnRenderer, *, token: str,
                 sampling_check: Callable[[dict], None] | None = None) -> None:
        self.renderer = renderer
        self.token = token  # the agents' api_key
        self.sampling_check = sampling_check
        self._open: dict[str, _Conversation] = {}

    # -- the run's side --------------------------------------------------------------------------
    def open_episode(self, row: dict, sample: Sampler, max_tokens_per_turn: int, *,
                     max_episode_tokens: int | None = None,
                     started: Callable[[Episode], None] | None = None) -> str:
        """A fresh episode id; `started(episode)` is told the Episode at the first call."""
        if max_tokens_per_turn < 1:
            raise ValueError(f"max_tokens_per_turn must be >= 1, got {max_tokens_per_turn}")
        episode_id = secrets.token_hex(12)
        self._open[episode_id] = _Conversation(row, sample, max_tokens_per_turn, max_episode_tokens, started)
        return episode_id

    def failure(self, episode_id: str) -> BaseException | None:
        """What `sample` raised in this episode, if it did (the episode cannot go on)."""
        conv = self._open.get(episode_id)
        return conv.failure if conv is not None else None

    def truncated(self, episode_id: str) -> bool:
        """Whether the episode's last call was refused because the episode is full."""
        conv = self._open.get(episode_id)
        return conv is not None and conv.truncated

    def close_episode(self, episode_id: str) -> Episode | None:
        """The episode its calls built (None: no call came); a call in flight is cancelled, and
        later calls naming it get 404."""
        conv = self._open.pop(episode_id, None)
        if conv is None:
            return None
        conv.closed = True
        if conv.scope is not None:
            conv.scope.cancel()  # the engine request is aborted; the call answers 404
        return conv.episode

    def routes(self) -> list:
        """Each path at the root and under `/e/{episode}` (the episode named by the URL)."""
        from starlette.routing import Route

        paths = [("/v1/chat/completions", self._chat, "POST"), ("/v1/completions", self._completion, "POST"),
                 ("/v1/responses", self._responses, "POST"), ("/v1/models", self._models, "GET")]
        return [Route(prefix + path, self._guarded(handler), methods=[method])
                for prefix in ("", "/e/{episode}") for path, handler, method in paths]

    # -- requests ----------------------------------------------------------------------------------
    def _guarded(self, handler):
        from starlette.responses import JSONResponse

        async def endpoint(request):
            try:
                self._authorize(request)
                answer = await handler(request)
                return JSONResponse(answer) if isinstance(answer, dict) else answer  # else a stream
            except Refused as exc:
                return error(exc.status, exc.param, exc.reason)
            except ConfigError as exc:  # a sampling check, or the template cannot extend the episode
                return error(400, exc.field, exc.reason)
            except Exception as exc:  # noqa: BLE001 - nothing a client sends may stop the run
                log.warning("agent.endpoint_error", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
                return error(500, "request", f"{type(exc).__name__}: {exc}")
        return endpoint

    def _authorize(self, request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise Refused(401, "Authorization", "missing or wrong token: send Authorization: Bearer <the run's "
                                                "token> (the openai client's api_key)")

    async def _models(self, request) -> dict:
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                            "owned_by": "inflight"}]}

    async def _begin(self, request, kind: str, known: set[str]) -> tuple[str, _Conversation, dict]:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise Refused(400, "body", f"not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Refused(400, "body", f"must be a JSON object, got {type(body).__name__}")
        episode_id = self._episode_id(request, body)
        conv = self.conversation(episode_id, kind)
        self._check_fields(body, known)
        return episode_id, conv, body

    def conversation(self, episode_id: str, kind: str) -> _Conversation:
        """The open episode a call of `kind` may go on with: 404 unknown or closed, 409 busy or
        failed, 400 of another kind."""
        conv = self._open.get(episode_id)
        if conv is None:
            raise Refused(404, "episode", f"no open episode {episode_id!r} (never opened, or closed: its agent "
                                          "ran past its end)")
        if conv.busy:
            raise Refused(409, "episode", f"episode {episode_id!r} has a call in flight: its calls go one at a time")
        if conv.kind not in (None, kind):
            raise Refused(400, "episode", f"episode {episode_id!r} is a {conv.kind} episode: one kind per episode")
        if conv.failure is not None:
            raise Refused(409, "episode", f"episode {episode_id!r} failed: {conv.failure}")
        return conv

    def _episode_id(self, request, body: dict) -> str:
        """The episode a call names: by its path (`/e/{episode}/...`), the header or the body
        field; any of them given must agree (400 naming the two that differ)."""
        field_ = body.get("episode")
        if field_ is not None and not isinstance(field_, str):
            raise Refused(400, "episode", f"must be a string, got {type(field_).__name__}")
        given = (("the path", request.path_params.get("episode")),
                 (f"the header {EPISODE_HEADER}", request.headers.get(EPISODE_HEADER)), ("the body field", field_))
        named = [(where, value) for where, value in given if value is not None]
        if not named:
            raise Refused(400, "episode", f"name the episode: the path /e/<episode>/v1/..., header {EPISODE_HEADER} "
                                          "or body field episode")
        for where, value in named[1:]:
            if value != named[0][1]:
                raise Refused(400, "episode", f"{named[0][0]} ({named[0][1]!r}) and {where} ({value!r}) name "
                                              "different episodes")
        return named[0][1]

    def _check_fields(self, body: dict, known: set[str]) -> None:
        unknown = sorted(k for k in body if k not in known | _IGNORED | SAMPLING_FIELDS)
        if unknown:
            raise Refused(400, unknown[0], "not a parameter this endpoint knows; it refuses what it cannot honour")
        if body.get("n") is not None and body["n"] != 1:
            raise Refused(400, "n", f"must be 1, got {body['n']!r}: an episode is one conversation")
        if body.get("stream") not in (None, True, False):
            raise Refused(400, "stream", f"must be a boolean, got {body['stream']!r}")
        for name in ("echo", "suffix"):
            if body.get(name):
                raise Refused(400, name, "not served")
        if body.get("top_logprobs"):
            raise Refused(400, "top_logprobs", "only each sampled token's own logprob is kept: ask logprobs=true")
        given = {k: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
        if given and self.sampling_check is None:
            name = sorted(given)[0]
            raise Refused(400, name, "this endpoint samples with the run's settings and cannot check this one")
        if given:
            self.sampling_check(body)

    def _max_new(self, body: dict, conv: _Conversation, prompt_len: int, names: tuple[str, ...], where: str) -> int:
        asked, name = conv.max_tokens_per_turn, names[0]
        for name in names:
            if body.get(name) is not None:
                asked = body[name]
                break
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise Refused(400, name, f"must be an integer >= 1, got {asked!r}")
        asked = min(asked, conv.max_tokens_per_turn)
        if conv.max_episode_tokens is not None:
            room = conv.max_episode_tokens - prompt_len
            if room < 1:  # worded as vLLM's: agents (verifiers) read it as "the context is full"
                conv.truncated = conv.episode is not None  # a first prompt too long is no episode
                raise Refused(400, where, f"This model's maximum context length is {conv.max_episode_tokens} "
                                          f"tokens; the episode's prompt would be {prompt_len} tokens")
            asked = min(asked, room)
        return asked

    async def _turn(self, conv: _Conversation, prompt: list[int], max_new: int):
        """Sample one turn; the engine's failure is the episode's (502 here, raised by the run)."""
        scope = conv.scope = anyio.CancelScope()
        with scope:
            try:
                turn = await conv.sample(list(prompt), max_new)
                if not conv.closed:  # a closed episode is the run's now: it is not changed after
                    conv.episode.add_sampled(turn)
                    conv.truncated = False  # it went on after all (a shorter extension fitted)
            except Exception as exc:  # noqa: BLE001 - the episode fails; the run reads failure()
                conv.failure = exc
                raise Refused(502, "episode", f"the engine's turn failed: {type(exc).__name__}: {exc}") from None
        conv.scope = None
        if scope.cancelled_caught or conv.closed:
            raise Refused(404, "episode", "the episode was closed during this call")
        return turn

    def _open_episode(self, conv: _Conversation, messages: list[dict], prompt_ids: list[int]) -> None:
        conv.episode = Episode(row=conv.row, messages=list(messages), prompt_ids=list(prompt_ids))
        if conv.started is not None:
            conv.started(conv.episode)

    # -- chat: /v1/chat/completions and /v1/responses ---------------------------------------------------
    async def _chat_turn(self, conv: _Conversation, body: dict, messages: list[dict], tools: list | None, *,
                         field_: str, max_names: tuple[str, ...]) -> ChatTurn:
        """One chat turn: the first renders `messages`, a later one must extend the episode's
        conversation (`agent_messages.extension`, errors naming `field_`'s items)."""
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        conv.busy = True
        try:
            if conv.episode is None:
                rendered, prompt = self._first_chat_prompt(plain, tools)
                max_new = self._max_new(body, conv, len(prompt), max_names, field_)
                self._open_episode(conv, rendered, prompt)
                conv.kind, conv.tools = "chat", tools
            else:
                if tools != conv.tools:
                    raise Refused(400, "tools", "differ from the episode's first call: the model saw those")
                new = extension(conv.seen, messages, field_)
                delta = self.renderer.delta(conv.history, conv.last_ids, new)
                prompt = conv.episode.next_prompt() + delta
                max_new = self._max_new(body, conv, len(prompt), max_names, field_)
                conv.episode.add_environment(delta)
                conv.episode.messages += new
            history = list(conv.episode.messages)
            turn = await self._turn(conv, prompt, max_new)
        finally:
            conv.busy = False
        raw = _reply_text(self.renderer, turn.token_ids)
        conv.history, conv.last_ids = history, list(turn.token_ids)
        conv.episode.messages.append({"role": "assistant", "content": raw})
        parse = bool(tools) and body.get("tool_choice") != "none"
        content, calls = split_tool_calls(raw, conv.episode.turns) if parse else (raw, None)
        conv.seen = messages + [{"role": "assistant", "content": content, "calls": [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls or []]}]
        return ChatTurn(turn, len(prompt), content, calls, conv.episode.turns)

    async def _chat(self, request):
        episode_id, conv, body = await self._begin(request, "chat", _CHAT)
        messages, tools = chat_messages(body.get("messages")), chat_tools(body)
        done = await self._chat_turn(conv, body, messages, tools, field_="messages",
                                     max_names=("max_completion_tokens", "max_tokens"))
        message = {"role": "assistant", "content": done.content or None, "tool_calls": done.calls} if done.calls \
            else {"role": "assistant", "content": done.content}
        choice = {"index": 0, "message": message,
                  "finish_reason": "tool_calls" if done.calls else done.turn.finish_reason or "stop",
                  "logprobs": {"content": self._logprob_items(done.turn)} if body.get("logprobs") else None,
                  "token_ids": list(done.turn.token_ids)}
        completion = reply("chat.completion", f"chatcmpl-{episode_id}-{done.number}", body, choice, done.prompt_len,
                           len(done.turn.token_ids))
        if not body.get("stream"):
            return completion
        pieces = None if done.calls else agent_stream.token_pieces(self.renderer, done.turn.token_ids, done.content)
        return agent_stream.sse_response(agent_stream.chat_chunks(completion, pieces,
                                                                  agent_stream.include_usage(body)))

    async def _responses(self, request):
        episode_id, conv, body = await self._begin(request, "chat", responses_api.FIELDS)
        responses_api.check(body)
        messages, tools = responses_api.chat_request(body)
        done = await self._chat_turn(conv, body, messages, tools, field_="input", max_names=("max_output_tokens",))
        logprobs = self._logprob_items(done.turn) if responses_api.LOGPROBS in (body.get("include") or []) else None
        response = responses_api.response(done, body, f"{episode_id}_{done.number}", logprobs)
        if not body.get("stream"):
            return response
        pieces = None if done.calls else agent_stream.token_pieces(self.renderer, done.turn.token_ids, done.content)
        return agent_stream.sse_response(responses_api.events(response, pieces))

    def _first_chat_prompt(self, messages: list[dict], tools: list | None) -> tuple[list[dict], list[int]]:
        """Turn 1's messages as rendered, and its tokens. Tools go through the template's `tools=`
        where it renders them; else they are described in the system message, the way
        `ToolEnvironment` does (the model must see them either way)."""
        if not tools:
            return messages, self.renderer.first_prompt(messages)
        tokenizer = self.renderer.tokenizer
        if "tools" in str(tokenizer.chat_template):
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            return messages, self.renderer.encode(text)
        described = ToolEnvironment.system_prompt + "\nTools:\n" + "\n".join(json.dumps(t) for t in tools)
        if messages[0]["role"] == "system":
            rendered = [{"role": "system", "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]]
        else:
            rendered = [{"role": "system", "content": described}, *messages]
        return rendered, self.renderer.first_prompt(rendered)

    def _logprob_items(self, turn) -> list[dict]:
        return [{"token": text, "logprob": finite(logprob), "bytes": list(text.encode()), "top_logprobs": []}
                for text, logprob in zip(self._token_texts(turn), turn.logprobs)]

    def _token_texts(self, turn) -> list[str]:
        # The renderer's decode: the tokenizer's text for each id (its byte table where it has one,
        # a fifth of transformers' time a token: 0.2 against 1.0 ms for 500 tokens on the run's loop).
        return [self.renderer.decode([t]) for t in turn.token_ids]

    # -- /v1/completions ----------------------------------------------------------------------------
    async def _completion(self, request):
        episode_id, conv, body = await self._begin(request, "completion", _TEXT)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise Refused(400, "prompt", "must be one non-empty string")
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or logprobs != 0):
            raise Refused(400, "logprobs", "only each sampled token's own logprob is kept: ask logprobs=0")
        conv.busy = True
        try:
            if conv.episode is None:
                ids = list(self.renderer.tokenizer(prompt)["input_ids"])  # as vLLM's /v1/completions: special tokens
                max_new = self._max_new(body, conv, len(ids), ("max_tokens",), "prompt")
                self._open_episode(conv, [], ids)
                conv.kind, full = "completion", ids
            else:
                if not prompt.startswith(conv.text):
                    at = next((i for i, (a, b) in enumerate(zip(conv.text, prompt)) if a != b), len(prompt))
                    raise Refused(400, "prompt", f"does not extend the episode's text (prompt + completions so far) "
                                                 f"at character {at}: a later call repeats it exactly and adds text")
                delta = self.renderer.encode(prompt[len(conv.text):])
                full = conv.episode.next_prompt() + delta
                max_new = self._max_new(body, conv, len(full), ("max_tokens",), "prompt")
                conv.episode.add_environment(delta)
            turn = await self._turn(conv, full, max_new)
        finally:
            conv.busy = False
        text = _reply_text(self.renderer, turn.token_ids)
        conv.text, conv.last_ids = prompt + text, list(turn.token_ids)
        choice = {"index": 0, "text": text, "finish_reason": turn.finish_reason or "stop",
                  "logprobs": self._text_logprobs(turn) if logprobs is not None else None,
                  "token_ids": list(turn.token_ids)}
        completion = reply("text_completion", f"cmpl-{episode_id}-{conv.episode.turns}", body, choice, len(full),
                           len(turn.token_ids))
        if not body.get("stream"):
            return completion
        pieces = agent_stream.token_pieces(self.renderer, turn.token_ids, text)
        return agent_stream.sse_response(agent_stream.text_chunks(completion, pieces, agent_stream.include_usage(body)))

    def _text_logprobs(self, turn) -> dict:
        tokens = self._token_texts(turn)
        return {"tokens": tokens, "token_logprobs": [finite(x) for x in turn.logprobs], "top_logprobs": None,
                "text_offset": [0, *itertools.accumulate(len(t) for t in tokens)][:len(tokens)]}
