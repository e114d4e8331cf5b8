"""Streamed replies of the agent endpoint (`stream: true`, docs/agents.md): Server-Sent Events in
OpenAI's chunk format, made from the reply the same call gives without streaming.

The engine's turn is sampled whole (the run's `sample` returns a whole turn), so the chunks are
sent once the turn is sampled: one chunk per sampled token (its text, and its logprob when asked),
or the whole content in one chunk where a token's own text cannot be told (a reply with tool calls,
whose content is the text outside them). The chunks' text always joins to exactly the content the
unstreamed reply carries: the client echoes it in its next call, compared character by character.
Every chunk is made before the first is sent, so nothing about the episode happens while they go
out: a client that leaves mid-stream leaves the episode as the whole reply left it."""

from __future__ import annotations

import json
from collections.abc import Sequence


def token_pieces(renderer, token_ids: Sequence[int], text: str) -> list[str] | None:
    """The text each sampled token adds (a stop token, or a byte of a character not yet whole,
    adds ""), joining to `text`; None when the tokenizer's streaming decode cannot tell them (no
    fast tokenizer, or its pieces do not join to `text`)."""
    from tokenizers.decoders import DecodeStream

    backend = getattr(renderer.tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    reply = len(renderer.reply_ids(token_ids))
    stream = DecodeStream(skip_special_tokens=False)
    pieces = [(stream.step(backend, int(t)) or "") if k < reply else "" for k, t in enumerate(token_ids)]
    return pieces if "".join(pieces) == text else None


def sse_response(events: list[tuple[str | None, object]]):
    """The events as `text/event-stream`: `event: <name>` when named, `data: <json>` (a string
    as it is: `[DONE]`)."""
    from starlette.responses import StreamingResponse

    async def body():
        for name, data in events:
            payload = data if isinstance(data, str) else json.dumps(data)
            yield (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def chat_chunks(completion: dict, pieces: list[str] | None, include_usage: bool) -> list[tuple[None, object]]:
    """A `chat.completion` as OpenAI streams it: the role, the content (a chunk per token), each
    tool call (its id and name, then its arguments), the finish reason, the usage when
    `stream_options.include_usage`, then `[DONE]`."""
    choice = completion["choices"][0]
    message, items = choice["message"], (choice["logprobs"] or {}).get("content")
    base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}

    def chunk(delta: dict, logprobs=None, finish=None, **extra) -> dict:
        out = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                                    **extra}]}
        return {**out, "usage": None} if include_usage else out

    chunks = [chunk({"role": "assistant", "content": ""})]
    calls = message.get("tool_calls")
    if pieces is not None and not calls:
        for k, piece in enumerate(pieces):
            if piece or items is not None:  # a token without text still carries its logprob
                chunks.append(chunk({"content": piece}, {"content": [items[k]]} if items is not None else None))
    elif message["content"] or items is not None:
        chunks.append(chunk({"content": message["content"] or ""}, {"content": items} if items is not None else None))
    for k, call in enumerate(calls or []):
        name = call["function"]["name"]
        chunks.append(chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                             "function": {"name": name, "arguments": ""}}]}))
        chunks.append(chunk({"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]}))
    chunks.append(chunk({}, finish=choice["finish_reason"], token_ids=choice["token_ids"]))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return [(None, c) for c in chunks] + [(None, "[DONE]")]


def text_chunks(completion: dict, pieces: list[str] | None, include_usage: bool) -> list[tuple[None, object]]:
    """A `text_completion` as OpenAI streams it: a chunk per token (its text, and its logprob
    when asked), the finish reason, the usage when `stream_options.include_usage`, `[DONE]`."""
    choice = completion["choices"][0]
    logprobs = choice["logprobs"]
    base = {"id": completion["id"], "object": "text_completion", "created": completion["created"],
            "model": completion["model"]}

    def chunk(text: str, logprobs=None, finish=None, **extra) -> dict:
        out = {**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                    **extra}]}
        return {**out, "usage": None} if include_usage else out

    if pieces is None:
        chunks = [chunk(choice["text"], logprobs)]
    else:
        chunks = [chunk(piece, _one_token(logprobs, k)) for k, piece in enumerate(pieces)
                  if piece or logprobs is not None]
    chunks.append(chunk("", finish=choice["finish_reason"], token_ids=choice["token_ids"]))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return [(None, c) for c in chunks] + [(None, "[DONE]")]


def _one_token(logprobs: dict | None, k: int) -> dict | None:
    if logprobs is None:
        return None
    return {"tokens": [logprobs["tokens"][k]], "token_logprobs": [logprobs["token_logprobs"][k]],
            "top_logprobs": None, "text_offset": [logprobs["text_offset"][k]]}


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
