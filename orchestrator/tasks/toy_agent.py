"""A toy agent written against the `openai` client (examples/agent.toml, docs/agents.md): it asks
for digits, then asks again, and scores itself by the share of digit characters in its two
replies. Any agent framework works the same way: it only needs the client it is given.

    [task]
    agent = "orchestrator.tasks.toy_agent:digits_agent"
    entrypoint = "orchestrator.tasks.toy_agent:rows"
"""

from __future__ import annotations


class Rows:
    """Endless rows (the agent needs none of their content)."""

    name = "digits_agent"

    def row(self, index: int) -> dict:
        return {"index": index}


def rows() -> Rows:
    return Rows()


async def digits_agent(client, row: dict) -> float:
    messages = [{"role": "user", "content": "Write digits."}]
    replies = []
    for _turn in range(2):
        response = await client.chat.completions.create(model="policy", messages=messages)
        reply = response.choices[0].message.content or ""
        replies.append(reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More digits."}]
    text = "".join(replies).replace(" ", "")
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0
