"""The Responses API on the agent endpoint (`POST /v1/responses`, docs/agents.md), stateless: each
call sends the whole conversation as input items (the OpenAI Agents SDK's default), mapped here onto
chat messages and checked as a chat call is (`agent_messages.extension`): it must extend the
episode's conversation, or it is a 400 naming the input item that differs (`input[3]`).

Input items: `message` (roles user, system, developer (read as system), assistant; content a string
or `input_text` / `output_text` parts), `function_call` (name, arguments, call_id: a call the model
made, part of the assistant message before it) and `function_call_output` (call_id, output: a
`tool` message). `instructions` is a system message before the input. `tools` come in the Responses
shape (`{"type": "function", "name", "description", "parameters"}`) and are read as chat tools.
Output items: a `message` with one `output_text` part (left out when the reply is only tool calls)
and a `function_call` per call; `status` "completed", or "incomplete" with `incomplete_details.reason
= "max_output_tokens"` when the turn was cut by its length.

Refused by name: `previous_response_id` and `conversation` (the state lives in the episode, not in
stored responses), `background`, `prompt` (stored prompts), `reasoning`, `max_tool_calls`, a `text`
format other than text, `truncation` other than "disabled", `include` other than
"message.output_text.logprobs". `store` is accepted and nothing is stored."""

from __future__ import annotations

import time

from orchestrator.tasks.agent_messages import Refused, check_tool_choice, model_name, text_of

FIELDS = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "stream", "include",
          "truncation", "text", "reasoning", "previous_response_id", "conversation", "background", "prompt",
          "max_tool_calls", "top_logprobs"}
LOGPROBS = "message.output_text.logprobs"
_STATEFUL = {"previous_response_id": "a response is not kept to continue from",
             "conversation": "no conversation is kept on the server",
             "background": "a response is answered in the call that asks it",
             "prompt": "stored prompts are not served",
             "reasoning": "the run samples with its own settings",
             "max_tool_calls": "the model's tool calls are not capped here"}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_PARTS = ("input_text", "output_text")


def check(body: dict) -> None:
    """Refuse what a stateless endpoint sampling with the run's settings cannot honour."""
    for name, why in _STATEFUL.items():
        if body.get(name) not in (None, False):
            raise Refused(400, name, f"not served: {why}; the episode holds the conversation, so send it "
                                     "whole as input each call")
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != LOGPROBS for x in include):
        raise Refused(400, "include", f"only {LOGPROBS!r} is served, got {include!r}")
    if body.get("truncation") not in (None, "disabled"):
        raise Refused(400, "truncation", "only \"disabled\": the episode's earlier turns are never dropped")
    text = body.get("text")
    if text is not None and text not in ({}, {"format": {"type": "text"}}):
        raise Refused(400, "text", "only the text format: output is never constrained here")


def chat_request(body: dict) -> tuple[list[dict], list | None]:
    """The call's conversation as chat messages (each naming its input item) and its tools."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise Refused(400, "instructions", "must be a string")
        messages.append({"role": "system", "content": instructions, "at": "instructions"})
    given = body.get("input")
    if isinstance(given, str) and given:
        messages.append({"role": "user", "content": given, "at": "input"})
    elif isinstance(given, list) and given:
        messages += _input_messages(given)
    else:
        raise Refused(400, "input", "must be a non-empty string or list of input items")
    check_tool_choice(body)
    return messages, function_tools(body.get("tools"))


def _input_messages(items: list) -> list[dict]:
    messages: list[dict] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise Refused(400, at, f"must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise Refused(400, f"{at}.role", f"must be one of {', '.join(_ROLES)}, got {item.get('role')!r}")
            content = text_of(item.get("content"), f"{at}.content", _PARTS)
            message = {"role": role, "content": content, "at": at}
            messages.append({**message, "calls": [], "call_at": []} if role == "assistant" else message)
        elif kind == "function_call":
            name, arguments, call_id = (_string(item, key, at) for key in ("name", "arguments", "call_id"))
            if not messages or messages[-1]["role"] != "assistant":  # a reply that is only calls
                messages.append({"role": "assistant", "content": "", "at": at, "calls": [], "call_at": []})
            messages[-1]["calls"].append((name, arguments))
            messages[-1]["call_at"].append(at)
            call_ids.add(call_id)
        elif kind == "function_call_output":
            if _string(item, "call_id", at) not in call_ids:
                raise Refused(400, f"{at}.call_id", f"names no function_call before it in input: "
                                                    f"{item['call_id']!r}")
            messages.append({"role": "tool", "content": text_of(item.get("output"), f"{at}.output", _PARTS),
                             "at": at})
        else:
            raise Refused(400, f"{at}.type", f"must be message, function_call or function_call_output, got {kind!r}")
    return messages


def _string(item: dict, key: str, at: str) -> str:
    if not isinstance(item.get(key), str):
        raise Refused(400, f"{at}.{key}", f"must be a string, got {type(item.get(key)).__name__}")
    return item[key]


def function_tools(tools) -> list | None:
    """Responses function tools in the chat shape; `strict` is dropped (the arguments are what
    the model samples, never constrained)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Refused(400, "tools", "must be a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise Refused(400, f"tools[{i}].type", f"only function tools are served, got {kind!r}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise Refused(400, f"tools[{i}].name", "must be a non-empty string")
        function = {"name": tool["name"]}
        function.update({k: tool[k] for k in ("description", "parameters") if tool.get(k) is not None})
        out.append({"type": "function", "function": function})
    return out or None


def response(reply, body: dict, ids: str, logprobs: list[dict] | None) -> dict:
    """The Responses object of one sampled chat turn (`reply`: the endpoint's `ChatTurn`)."""
    output = []
    cut = reply.turn.finish_reason == "length"
    if reply.content or not reply.calls:
        part = {"type": "output_text", "text": reply.content, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        output.append({"type": "message", "id": f"msg_{ids}", "status": "incomplete" if cut else "completed",
                       "role": "assistant", "content": [part]})
    for k, call in enumerate(reply.calls or []):
        output.append({"type": "function_call", "id": f"fc_{ids}_{k}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    prompt, sampled = reply.prompt_len, len(reply.turn.token_ids)
    return {"id": f"resp_{ids}", "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model_name(body), "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None, "store": False, "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "truncation": "disabled", "metadata": body.get("metadata") or {},
            "usage": {"input_tokens": prompt, "output_tokens": sampled, "total_tokens": prompt + sampled}}


def events(done: dict, pieces: list[str] | None) -> list[tuple[str, dict]]:
    """The Responses stream of a whole response, as OpenAI sends it (what the Agents SDK reads):
    created, in_progress, each output item added, its text deltas (one per token where `pieces`
    tell them) or its call's arguments, done, then completed (or incomplete)."""
    out: list[tuple[str, dict]] = []

    def emit(kind: str, **fields) -> None:
        out.append((kind, {"type": kind, "sequence_number": len(out), **fields}))

    start = {**done, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for index, item in enumerate(done["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                         "content": []})
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            emit("response.content_part.added", **where, part={**part, "text": "", **_no_logprobs(part)})
            logprobs = part.get("logprobs")
            if pieces is not None and (logprobs is None or len(logprobs) == len(pieces)):
                for k, piece in enumerate(pieces):
                    if piece or logprobs is not None:
                        emit("response.output_text.delta", **where, delta=piece,
                             logprobs=[logprobs[k]] if logprobs is not None else [])
            else:
                emit("response.output_text.delta", **where, delta=part["text"], logprobs=logprobs or [])
            emit("response.output_text.done", **where, text=part["text"], logprobs=logprobs or [])
            emit("response.content_part.done", **where, part=part)
        else:
            emit("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                         "status": "in_progress"})
            where = {"item_id": item["id"], "output_index": index}
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
    return out


def _no_logprobs(part: dict) -> dict:
    return {"logprobs": []} if "logprobs" in part else {}
