"""Tools for tool-calling episodes (issue #19): plain Python functions described to the model
by a JSON schema built from their type hints and docstring, the model's calls parsed in the
Hermes / Qwen format, and each call run with its error returned to the model as text.

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first
            b: the second
        '''

    tool_schema(add) -> {"type": "function", "function": {"name": "add", "description": "Add two
        integers.", "parameters": {"type": "object", "properties": {"a": {"type": "integer",
        "description": "the first"}, ...}, "required": ["a", "b"]}}}

A call is `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>` in the
model's text. Text that opens a call but does not parse is a `MalformedToolCall`, with why:
the episode ends that turn recording `malformed_tool_call`, it does not guess. `call_tool` runs
a call through the user-code runner (`user_code.py`): a blocking tool holds a worker thread,
never the loop other episodes' steps run on.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.errors import UserCodeTimeout
from orchestrator.tasks.user_code import UserCode, current

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class MalformedToolCall:
    reason: str
    text: str


def tool_schema(fn: Callable) -> dict:
    """The OpenAI-style function schema of `fn` (what chat templates render as `tools`)."""
    doc = inspect.getdoc(fn) or ""
    summary, params_doc = _parse_doc(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, dict] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *{name} cannot be described to a model; name every argument")
        prop = _json_type(hints.get(name, str), f"{fn.__name__}({name})")
        if name in params_doc:
            prop["description"] = params_doc[name]
        properties[name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": summary,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def parse_tool_calls(text: str) -> list[ToolCall] | MalformedToolCall:
    """Every call in `text`, in order ([] when it makes none)."""
    calls: list[ToolCall] = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except ValueError as exc:
            return MalformedToolCall(f"not JSON: {exc}", body)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return MalformedToolCall("a call is an object with a string \"name\"", body)
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                return MalformedToolCall(f"arguments are not JSON: {exc}", body)
        if not isinstance(arguments, dict):
            return MalformedToolCall("\"arguments\" is not an object", body)
        calls.append(ToolCall(data["name"], arguments))
    if text.count(_OPEN) != len(calls):
        return MalformedToolCall(f"{text.count(_OPEN)} {_OPEN} opened, {len(calls)} closed", text)
    return calls


async def call_tool(tools: dict[str, Callable], call: ToolCall, *, timeout_s: float = 30.0,
                    user_code: UserCode | None = None) -> str:
    """Run one call through `user_code` (default: the runner of the call this runs in): a plain
    def in a worker thread, an async one on the user-code loop. Its result as text (JSON for
    anything but a string). A tool that raises, an unknown tool or wrong arguments: the error, as
    text for the model. A tool past `timeout_s`: UserCodeTimeout naming it (its episode ends)."""
    fn = tools.get(call.name)
    if fn is None:
        return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools))})"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return f"error: {call.name}: {exc}"
    runner = user_code or current()
    try:
        result = await runner.call(functools.partial(fn, **call.arguments), timeout_s=timeout_s,
                                   what=f"tool {call.name!r}")
    except UserCodeTimeout:
        raise  # not an answer for the model: a tool that hangs ends its episode, named
    except Exception as exc:  # noqa: BLE001 - the model reads what went wrong
        return f"error: {call.name} raised {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else json.dumps(result, default=str)


def _json_type(hint, where: str) -> dict:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
        return {"anyOf": [_json_type(a, where) for a in options]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (list, tuple, set):
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise TypeError(f"tool {where}: type {hint!r} has no JSON schema (use int, float, str, bool, list, dict, "
                    "Literal or Optional of those)")


def _parse_doc(doc: str) -> tuple[str, dict[str, str]]:
    """The summary (text before an `Args:` section) and each argument's description."""
    summary, _, rest = doc.partition("\nArgs:")
    params: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        match = re.match(r"^\s{2,}(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)
        if match:
            current = match.group(1)
            params[current] = match.group(2).strip()
        elif current and line.strip() and not re.match(r"^\S", line):
            params[current] += " " + line.strip()
        elif line.strip():
            break  # the next section (Returns:, Raises:)
    return " ".join(summary.split()), params
