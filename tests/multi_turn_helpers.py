"""A tiny model that calls a tool (for the tool-episode tests): tiny-rl fine-tuned for a few
seconds on one calculator conversation, so that `inflight run` with the calculator environment
sees real `<tool_call>`s from a real engine (a random tiny model never writes one)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

from orchestrator.tasks.toy_env import Calculator

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def tool_conversation(tokenizer) -> tuple[list[int], list[bool]]:
    """(token ids, trained-on mask) of: the calculator's system + user prompt, the call, the
    tool's answer, the final answer; the loss is on the assistant's tokens only."""
    env = Calculator()
    start = asyncio.run(env.reset({"a": 1, "b": 2}))
    turns = [*start, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "3"},
             {"role": "assistant", "content": "3"}]
    return conversation_ids(tokenizer, turns)


def conversation_ids(tokenizer, turns: list[dict]) -> tuple[list[int], list[bool]]:
    """(token ids, trained-on mask) of `turns` as the template renders them, turn by turn; the
    loss is on the assistant's tokens only."""
    ids: list[int] = []
    mask: list[bool] = []
    for n in range(1, len(turns) + 1):
        text = tokenizer.apply_chat_template(turns[:n], tokenize=False, add_generation_prompt=False)
        new = tokenizer(text, add_special_tokens=False)["input_ids"][len(ids):]
        ids += new
        mask += [turns[n - 1]["role"] == "assistant"] * len(new)
    return ids, mask


def build_tool_model(base: Path, out: Path, steps: int = 800, lr: float = 3e-3, loss_below: float = 0.02) -> Path:
    """`base` fine-tuned on `tool_conversation` until its loss is below `loss_below` (at most
    `steps` steps; a model that never gets there fails here, by name, not later as a run whose
    episodes call no tool), saved with save_pretrained at `out` (reused when there). lr 1e-2 was
    seen to oscillate around 0.6 for 400 steps on a rebuilt tiny-rl; 3e-3 converged in 218."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids, mask = tool_conversation(tokenizer)
    x = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        loss = model(input_ids=x, labels=labels).loss
        if loss.item() < loss_below:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"the tool model did not learn its conversation: loss {loss.item():.3f} after {steps} "
                             f"steps (lr {lr}), above {loss_below}")
    return save_tuned(model, tokenizer, out, {"base": str(base), "steps": step, "loss": loss.item()})


def save_tuned(model, tokenizer, out: Path, sft: dict) -> Path:
    """A tuned model at `out`, whole or not at all (written beside it, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "sft.json").write_text(json.dumps(sft))
    tmp.rename(out)
    return out


class OnePlusTwo(Calculator):
    """The calculator with every row 1 + 2: what `build_tool_model`'s model was tuned on."""

    def row(self, index: int) -> dict:
        return {"a": 1, "b": 2}


def one_plus_two(max_turns: int = 3) -> OnePlusTwo:
    return OnePlusTwo(max_turns=max_turns)
