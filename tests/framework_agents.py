"""Agents written with agent frameworks, unchanged but for their base URL and key (docs/agents.md
shows them as recipes): the OpenAI Agents SDK (its default model, the Responses API; `Runner.run`
and `Runner.run_streamed`) and LangChain (`ChatOpenAI(streaming=True)`, Chat Completions). Each
asks 1 + 2 with an `add` tool, runs the tool when the model calls it, and scores 1.0 when its final
answer holds "3". The unit tests run them against a scripted sampler, the engine tests and the
run test against a real engine (`tool_agent_model`: tiny-rl tuned for seconds on their own
conversations, so that a real engine calls the tool)."""

from __future__ import annotations

from pathlib import Path

QUESTION = "What is 1 + 2? Use the add tool."
INSTRUCTIONS = "You add numbers."
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# -- the OpenAI Agents SDK -------------------------------------------------------------------------
def _sdk_agent(client):
    from agents import Agent, OpenAIResponsesModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent to OpenAI from a training run
    # An unchanged client: only the base URL (which names the episode) and the key of the one given.
    own = AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    return Agent(name="adder", instructions=INSTRUCTIONS, tools=[function_tool(add)],
                 model=OpenAIResponsesModel(model="policy", openai_client=own))


async def sdk_agent(client, row: dict) -> float:
    from agents import Runner
    from agents.exceptions import ModelBehaviorError

    try:
        result = await Runner.run(_sdk_agent(client), QUESTION)
    except ModelBehaviorError:  # a turn cut by max_tokens is an incomplete response: scored 0
        return 0.0
    return 1.0 if "3" in str(result.final_output) else 0.0


async def sdk_streamed_agent(client, row: dict) -> float:
    from agents import Runner
    from agents.exceptions import ModelBehaviorError

    result = Runner.run_streamed(_sdk_agent(client), QUESTION)
    try:
        async for _event in result.stream_events():
            pass
    except ModelBehaviorError:
        return 0.0
    return 1.0 if "3" in str(result.final_output) else 0.0


# -- LangChain -------------------------------------------------------------------------------------
async def langchain_agent(client, row: dict) -> float:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    add_tool = tool(add)
    llm = ChatOpenAI(model="policy", streaming=True, base_url=str(client.base_url), api_key=client.api_key,
                     max_retries=0).bind_tools([add_tool])
    messages = [SystemMessage(INSTRUCTIONS), HumanMessage(QUESTION)]
    for _turn in range(3):
        reply = await llm.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return 1.0 if "3" in reply.content else 0.0
        for call in reply.tool_calls:
            messages.append(ToolMessage(str(add_tool.invoke(call["args"])), tool_call_id=call["id"]))
    return 0.0


# -- a tiny model that calls the tool ---------------------------------------------------------------
def first_messages(kind: str) -> tuple[list[dict], list[dict]]:
    """(messages, chat tools) of the first call each framework makes: what the model is tuned on."""
    params = {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
              "type": "object"}
    if kind == "sdk":
        from agents import function_tool

        from orchestrator.tasks.responses_api import function_tools

        sdk_tool = function_tool(add)
        tools = function_tools([{"type": "function", "name": sdk_tool.name, "description": sdk_tool.description,
                         "parameters": sdk_tool.params_json_schema, "strict": True}])
    else:
        tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                   "parameters": params}}]
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], tools


def tool_agent_model(base: Path, out: Path, steps: int = 800, lr: float = 3e-3, loss_below: float = 0.02) -> Path:
    """`base` tuned until it calls add(1, 2) and then answers 3 in both frameworks' conversations
    (rendered as the endpoint renders them), saved at `out` (reused when there)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.tasks.agent_endpoint import AgentEndpoint
    from orchestrator.tasks.turns import TurnRenderer
    from tests.multi_turn_helpers import conversation_ids, save_tuned

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    endpoint = AgentEndpoint(TurnRenderer(tokenizer), token="-")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    batches = []
    for kind in ("sdk", "langchain"):
        messages, tools = first_messages(kind)
        rendered, _ = endpoint._first_chat_prompt(messages, tools)
        ids, mask = conversation_ids(tokenizer, [*rendered, {"role": "assistant", "content": CALL},
                                              {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}])
        batches.append((torch.tensor([ids]), torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        loss = sum(model(input_ids=x, labels=y).loss for x, y in batches) / len(batches)
        if loss.item() < loss_below:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"the tool agent model did not learn: loss {loss.item():.3f} after {steps} steps")
    return save_tuned(model, tokenizer, out, {"base": str(base), "steps": step, "loss": loss.item()})


