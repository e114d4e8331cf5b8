"""Token in, token out (issue #33, docs/agents.md): the generate route of vLLM's token API, the one
verifiers 0.4's `TrainClient` (through `renderers.client.generate`) and prime-rl's trainer-side
inference server speak, served on the agent endpoint:

    POST /inference/v1/generate              (episode by header X-Inflight-Episode or body `episode`)
    POST /e/{episode}/inference/v1/generate  (episode by path: a client whose base URL is
                                              {run}/e/{episode}/v1 lands here)

A call sends `token_ids`, the whole prompt as token ids. The first call of an episode opens it
with them as its prompt; every later call must extend the episode's tokens so far (its prompt,
every sampled token, every environment token) — else a 400 naming `token_ids[i]`, the first index
that differs — and the tokens it adds are recorded as environment tokens (not trained on, no
logprob). No template, no tool parsing: the client renders, the endpoint keeps what it is sent.
`sampling_params` are judged by the endpoint's `sampling_check` (the run's settings; a parameter
that would change what is sampled is refused, named `sampling_params.<name>`); `stop_token_ids`
may name only ids the run's turns end on anyway; `max_tokens` is capped as the chat route caps
it. The reply has vLLM's generate shape as verifiers reads it: `choices[0].token_ids`,
`choices[0].logprobs.content[k] = {token: "token_id:N", token_id: N, logprob}`,
`choices[0].finish_reason`, `prompt_token_ids`, `usage`.
"""

from __future__ import annotations

import json
import time

from orchestrator.errors import ConfigError
from orchestrator.tasks.agent_endpoint import MODEL_NAME, SAMPLING_FIELDS, AgentEndpoint, Refused, _Conversation
from orchestrator.tasks.agent_messages import finite

KIND = "tokens"
# Body fields beside the prompt and the sampling parameters. Accepted and ignored: they change
# neither what is sampled nor what is recorded (the run salts its engines' caches itself).
_BODY_IGNORED = {"model", "episode", "request_id", "cache_salt", "priority", "return_token_ids"}
# Sampling parameters that change only how the reply is shown, never what is sampled.
_SP_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "include_stop_str_in_output",
               "routed_experts_prompt_start"}  # prime-rl's MoE routing replay: no routing here
_SP_HANDLED = {"max_tokens", "logprobs", "n", "stop_token_ids", "prompt_logprobs"}


def served_routes(endpoint: AgentEndpoint) -> list:
    """Every route of an agent endpoint: its OpenAI routes and the generate route (what the run mounts)."""
    return endpoint.routes() + token_routes(endpoint)


def token_routes(endpoint: AgentEndpoint) -> list:
    from starlette.routing import Route

    handler = endpoint._guarded(TokenRoute(endpoint).generate)
    return [Route("/inference/v1/generate", handler, methods=["POST"]),
            Route("/e/{episode}/inference/v1/generate", handler, methods=["POST"])]


class TokenRoute:
    """The generate route over one endpoint's episodes (its kind: "tokens")."""

    def __init__(self, endpoint: AgentEndpoint) -> None:
        self.endpoint = endpoint

    async def generate(self, request) -> dict:
        body = _body(await request.body())
        episode_id = self.endpoint._episode_id(request, body)
        conv = self._conversation(episode_id)
        _check_body(body)
        prompt = self._token_ids(body.get("token_ids"))
        sp = self._sampling_params(body.get("sampling_params"))
        conv.busy = True
        try:
            if conv.episode is None:
                max_new = self._max_new(sp, conv, len(prompt))
                self.endpoint._open_episode(conv, [], prompt)
                conv.kind = KIND
            else:
                tail = _extension(conv.episode.next_prompt(), prompt)
                max_new = self._max_new(sp, conv, len(prompt))
                conv.episode.add_environment(tail)
            turn = await self.endpoint._turn(conv, prompt, max_new)
        finally:
            conv.busy = False
        conv.last_ids = list(turn.token_ids)
        return self._reply(body, sp, episode_id, conv, prompt, turn)

    # -- the request -------------------------------------------------------------------------------
    def _conversation(self, episode_id: str) -> _Conversation:
        return self.endpoint.conversation(episode_id, KIND)

    def _token_ids(self, value) -> list[int]:
        if not isinstance(value, list) or not value:
            raise Refused(400, "token_ids", "must be a non-empty list of token ids (the whole prompt)")
        vocab = len(self.endpoint.renderer.tokenizer)
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise Refused(400, f"token_ids[{i}]", f"must be a token id in [0, {vocab}), got {t!r}")
        return value

    def _sampling_params(self, value) -> dict:
        """The request's sampling parameters, checked: what would change what is sampled is the
        run's (or refused, named), what only changes how a reply is shown is ignored."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise Refused(400, "sampling_params", f"must be an object, got {type(value).__name__}")
        sp = {k: v for k, v in value.items() if v is not None}
        unknown = sorted(k for k in sp if k not in SAMPLING_FIELDS | _SP_IGNORED | _SP_HANDLED)
        if unknown:
            raise Refused(400, f"sampling_params.{unknown[0]}", "not a parameter this route knows; it refuses what "
                                                                "it cannot honour")
        if sp.get("n", 1) != 1:
            raise Refused(400, "sampling_params.n", f"must be 1, got {sp['n']!r}: an episode is one sequence")
        for name in ("logprobs", "prompt_logprobs"):  # vLLM: 0 = the sampled token's own; 1 = that one and the top
            allowed = (0, 1) if name == "logprobs" else (0,)
            if name in sp and (isinstance(sp[name], bool) or sp[name] not in allowed):
                raise Refused(400, f"sampling_params.{name}", f"only each sampled token's own logprob is kept: "
                                                              f"ask {' or '.join(map(str, allowed))}, got {sp[name]!r}")
        self._check_stop_ids(sp.get("stop_token_ids"))
        given = {k: v for k, v in sp.items() if k in SAMPLING_FIELDS and k != "stop_token_ids"}
        if given and self.endpoint.sampling_check is None:
            raise Refused(400, f"sampling_params.{sorted(given)[0]}", "this endpoint samples with the run's settings "
                                                                     "and cannot check this one")
        if given:
            try:
                self.endpoint.sampling_check(given)
            except ConfigError as exc:
                raise Refused(400, f"sampling_params.{exc.field}", exc.reason) from None
        return sp

    def _check_stop_ids(self, value) -> None:
        """A client's stop ids (verifiers sends its renderer's) are honoured when the run's turns
        end on each of them anyway; one the run does not stop on would change what is sampled."""
        if value is None:
            return
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise Refused(400, "sampling_params.stop_token_ids", "must be a list of token ids")
        own = self.endpoint.renderer.stop_ids
        other = [t for t in value if t not in own]
        if other:
            raise Refused(400, "sampling_params.stop_token_ids", f"the run's turns end on {sorted(own)}, the request "
                                                                 f"also asks {other}: an agent's calls sample with the "
                                                                 "run's settings (its records say so)")

    def _max_new(self, sp: dict, conv: _Conversation, prompt_len: int) -> int:
        try:
            return self.endpoint._max_new(sp, conv, prompt_len, ("max_tokens",), "token_ids")
        except Refused as exc:
            if exc.param == "max_tokens":
                exc.param = "sampling_params.max_tokens"
            raise

    # -- the reply ---------------------------------------------------------------------------------
    def _reply(self, body: dict, sp: dict, episode_id: str, conv: _Conversation, prompt: list[int], turn) -> dict:
        ids = list(turn.token_ids)
        logprobs = None
        if "logprobs" in sp:  # JSON has no -inf: such a token's logprob is null (the episode keeps it)
            logprobs = {"content": [{"token": f"token_id:{t}", "token_id": t, "logprob": finite(lp)}
                                    for t, lp in zip(ids, turn.logprobs)]}
        request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else \
            f"gen-{episode_id}-{conv.episode.turns}"
        choice = {"index": 0, "token_ids": ids, "logprobs": logprobs, "finish_reason": turn.finish_reason or "stop"}
        return {"request_id": request_id, "model": body.get("model") if isinstance(body.get("model"), str) else MODEL_NAME,
                "created": int(time.time()), "prompt_token_ids": list(prompt), "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}


def _body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise Refused(400, "body", f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Refused(400, "body", f"must be a JSON object, got {type(body).__name__}")
    return body


def _check_body(body: dict) -> None:
    unknown = sorted(k for k in body if k not in _BODY_IGNORED | {"token_ids", "sampling_params", "stream",
                                                                  "output_mode"})
    if unknown:  # features, content_parts: the model reads text; transfer params: no disaggregation here
        raise Refused(400, unknown[0], "not a field this route knows; it refuses what it cannot honour")
    if body.get("stream"):
        raise Refused(400, "stream", "streaming is not served on the generate route; ask without stream")
    if body.get("output_mode") not in (None, "tokens"):
        raise Refused(400, "output_mode", f"only \"tokens\": the route returns token ids, got {body['output_mode']!r}")


def _extension(episode: list[int], prompt: list[int]) -> list[int]:
    """The tokens `prompt` adds to the episode's (400 naming the first index that differs)."""
    for i, recorded in enumerate(episode):
        if i >= len(prompt):
            raise Refused(400, f"token_ids[{i}]", f"missing: the episode has {len(episode)} tokens so far; a later "
                                                  "call sends them all and adds new ones")
        if prompt[i] != recorded:
            raise Refused(400, f"token_ids[{i}]", f"differs from the episode's token there (recorded {recorded}, got "
                                                  f"{prompt[i]}): a later call extends the episode's tokens so far "
                                                  "(prompt, sampled and environment tokens), never rewrites them")
    return prompt[len(episode):]

