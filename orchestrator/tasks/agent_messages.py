"""What the agent endpoint (`agent_endpoint.py`) reads from a chat request and how it checks that a
call extends its episode's conversation; the Responses API (`responses_api.py`) maps its input items
onto the same messages, so both are checked alike.

A message here is `{"role", "content"}` (text content), and may carry, where the request came
from Responses input items: `at` (the name of the item it came from, for errors: `input[3]`),
and on an assistant message `calls` (the function calls it made, as `(name, arguments)`) with
`call_at` (each call's item name). Chat messages carry none of them: their tool calls are not
compared (the chat endpoint compared role and content before Responses came, and still does)."""

from __future__ import annotations

import json
import math
import re
import time

from orchestrator.tasks.tools import MalformedToolCall, parse_tool_calls

MODEL_NAME = "inflight"
ROLES = ("system", "user", "assistant", "tool")
_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class Refused(Exception):
    """A request the endpoint answers with an HTTP error naming `param`."""

    def __init__(self, status: int, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.status, self.param, self.reason = status, param, reason


def chat_messages(value) -> list[dict]:
    """The request's messages as {role, content} with text content (parts joined)."""
    if not isinstance(value, list) or not value:
        raise Refused(400, "messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise Refused(400, f"messages[{i}]", f"must be an object, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise Refused(400, f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        out.append({"role": m["role"], "content": text_of(m.get("content"), f"messages[{i}].content")})
    return out


def text_of(content, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Text content: a string, or a list of text parts (of the `kinds` given) joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise Refused(400, where, f"must be a string or a list of {'/'.join(kinds)} parts (the model reads text only)")


def chat_tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise Refused(400, "tools", "must be a list of tool objects")
    check_tool_choice(body)
    return tools or None


def check_tool_choice(body: dict) -> None:
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise Refused(400, "tool_choice", f"only \"auto\" or \"none\": a call cannot be forced, got "
                                          f"{body['tool_choice']!r}")


def extension(seen: list[dict], messages: list[dict], field: str = "messages") -> list[dict]:
    """The messages a later call adds to the episode's conversation (400 if it does not extend
    it), as {role, content}. `field`: the request's list ("messages", or "input" for Responses)."""
    for i, recorded in enumerate(seen):
        if i >= len(messages):
            name = f"{field}[{i}]" if field == "messages" else field
            raise Refused(400, name, f"missing: the episode's conversation has {len(seen)} messages; a later call "
                                     "repeats them all and adds new ones")
        got, name = messages[i], messages[i].get("at", f"{field}[{i}]")
        if (got["role"], got["content"]) != (recorded["role"], recorded["content"]):
            raise Refused(400, name, f"differs from the episode's conversation (recorded {recorded['role']} "
                                     f"{recorded['content'][:60]!r}, got {got['role']} {got['content'][:60]!r}): "
                                     "earlier turns are never tokenized again")
        if "calls" in got:
            _check_calls(recorded.get("calls", []), got, name)
    new = messages[len(seen):]
    if not new:
        raise Refused(400, field, "adds no message after the model's last reply")
    for j, m in enumerate(new):
        if m["role"] == "assistant":
            name = m.get("at", f"{field}[{len(seen) + j}]")
            raise Refused(400, f"{name}.role" if "at" not in m else name,
                          "a new message cannot be the assistant's: the model's turns are the ones sampled here")
    return [{"role": m["role"], "content": m["content"]} for m in new]


def _check_calls(recorded: list[tuple[str, str]], got: dict, name: str) -> None:
    """The function calls an assistant message repeats are the ones the model made, as returned."""
    calls, where = got["calls"], got.get("call_at", [])
    for k in range(max(len(recorded), len(calls))):
        if k < len(recorded) and k < len(calls) and calls[k] == recorded[k]:
            continue
        at = where[k] if k < len(where) else name
        was = f"{recorded[k][0]}({recorded[k][1]})" if k < len(recorded) else "no call"
        now = f"{calls[k][0]}({calls[k][1]})" if k < len(calls) else "no call"
        raise Refused(400, at, f"differs from the function call the model made (recorded {was[:80]}, got "
                               f"{now[:80]}): earlier turns are never tokenized again")


def split_tool_calls(raw: str, turn: int) -> tuple[str, list[dict] | None]:
    """The reply's text outside its tool calls, and the calls as OpenAI `tool_calls` (None when
    it makes none or they do not parse: then the agent gets the text as it was sampled)."""
    calls = parse_tool_calls(raw)
    if isinstance(calls, MalformedToolCall) or not calls:
        return raw, None
    return _CALL_BLOCK.sub("", raw).strip(), [
        {"id": f"call_{turn}_{k}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for k, c in enumerate(calls)]


def model_name(body: dict) -> str:
    return body.get("model") if isinstance(body.get("model"), str) else MODEL_NAME


def reply(kind: str, reply_id: str, body: dict, choice: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": reply_id, "object": kind, "created": int(time.time()), "model": model_name(body),
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no -inf; the episode keeps the value itself


def error(status: int, param: str, reason: str):
    from starlette.responses import JSONResponse

    kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": f"{param}: {reason}", "type": kind, "param": param, "code": status}},
                        status_code=status)
