"""Tools for tool-calling episodes (orchestrator/tasks/tools.py): schemas from type hints and
docstrings, Hermes/Qwen tool calls parsed or reported malformed, errors returned as text."""

from __future__ import annotations

from typing import Literal

import pytest

from orchestrator.tasks.tools import MalformedToolCall, ToolCall, call_tool, parse_tool_calls, tool_schema


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second,
            defaulting to zero
    Returns:
        the sum
    """
    return a + b


async def lookup(key: str, mode: Literal["fast", "exact"] | None = None, tags: list[str] | None = None) -> dict:
    """Look a key up."""
    if key == "missing":
        raise KeyError(key)
    return {"key": key, "mode": mode}


def test_a_schema_comes_from_type_hints_and_the_docstring():
    s = tool_schema(add)["function"]
    assert s["name"] == "add" and s["description"] == "Add two integers."
    assert s["parameters"]["properties"] == {"a": {"type": "integer", "description": "the first"},
                                             "b": {"type": "integer", "description": "the second, defaulting to zero"}}
    assert s["parameters"]["required"] == ["a"]
    p = tool_schema(lookup)["function"]["parameters"]
    assert p["properties"]["mode"] == {"enum": ["fast", "exact"]}
    assert p["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    assert p["required"] == ["key"]


def test_a_tool_whose_arguments_cannot_be_described_is_refused():
    def bad(*values: int) -> int:
        return 0

    with pytest.raises(TypeError, match=r"\*values"):
        tool_schema(bad)

    def opaque(x: object) -> int:
        return 0

    with pytest.raises(TypeError, match=r"opaque\(x\)"):
        tool_schema(opaque)


def test_calls_are_parsed_in_order_and_string_arguments_decoded():
    text = ('thinking...<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and '
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"k\\"}"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "k"})]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize("text,why", [
    ("<tool_call>{name: add}</tool_call>", "not JSON"),
    ("<tool_call>[1, 2]</tool_call>", "string \"name\""),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "not an object"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "1 <tool_call> opened, 0 closed"),
])
def test_a_call_that_does_not_parse_is_malformed_with_why(text, why):
    out = parse_tool_calls(text)
    assert isinstance(out, MalformedToolCall) and why in out.reason


async def test_a_call_runs_and_every_failure_comes_back_as_text():
    tools = {"add": add, "lookup": lookup}
    assert await call_tool(tools, ToolCall("add", {"a": 2, "b": 3})) == "5"
    assert await call_tool(tools, ToolCall("lookup", {"key": "k"})) == '{"key": "k", "mode": null}'
    assert (await call_tool(tools, ToolCall("lookup", {"key": "missing"}))).startswith("error: lookup raised KeyError")
    assert "no tool named 'mul'" in await call_tool(tools, ToolCall("mul", {}))
    assert "unexpected keyword argument 'c'" in await call_tool(tools, ToolCall("add", {"a": 1, "c": 2}))
