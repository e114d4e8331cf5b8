"""A `renderers` renderer for the tiny model's ChatML template (run in the verifiers 0.4 venv, named
by `renderers.CustomRendererConfig(import_path=...)`, the seam renderers gives a model it has no
renderer for). `DefaultRenderer` renders whole conversations again every turn (the model's
sampled tokens retokenized from their text); this one bridges, as renderers' own model renderers
do: the next prompt is the previous prompt and completion kept verbatim, the closing token the
template writes when the completion was cut before it, then the new messages rendered alone."""

from __future__ import annotations

from pydantic import ConfigDict
from renderers.base import RenderedTokens
from renderers.configs import BaseRendererConfig
from renderers.default import DefaultRenderer


class ChatMLBridgeConfig(BaseRendererConfig):
    model_config = ConfigDict(frozen=True, extra="allow")


class ChatMLBridge(DefaultRenderer):
    config_class = ChatMLBridgeConfig

    def __init__(self, tokenizer, config=None) -> None:
        super().__init__(tokenizer, None)
        self._end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._newline = tokenizer.encode("\n", add_special_tokens=False)

    def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None,
                            **kwargs):
        if any(m.get("role") == "assistant" for m in new_messages):
            return None  # never retokenize what the model sampled
        prior = list(previous_prompt_ids) + list(previous_completion_ids)
        if not previous_completion_ids or previous_completion_ids[-1] != self._end:
            prior.append(self._end)
        ids, indices = prior + self._newline, [-1] * (len(prior) + len(self._newline))
        for i, message in enumerate(new_messages):
            part = self._apply([message], tools=tools)
            ids += part
            indices += [i] * len(part)
        generation = self._apply(new_messages, tools=tools, add_generation_prompt=True)[
            len(self._apply(new_messages, tools=tools)):]
        return RenderedTokens(token_ids=ids + generation, message_indices=indices + [-1] * len(generation),
                              message_roles=[m.get("role") or "" for m in new_messages])
