"""Token in, token out across the turns of an episode (issue #19): the prompt of turn k+1 is
the episode's exact token sequence so far (every prompt and sampled token, as the engine saw
and produced them) plus the tokens of the chat template's *delta* for the new messages; no
earlier turn is ever tokenized again.

The delta comes from rendering text, never from re-tokenizing the past:

    before = render(history + [assistant(reply)], add_generation_prompt=False)
    after  = render(history + [assistant(reply)] + new_messages, add_generation_prompt=True)

`after` must start with `before` (the template is prefix-preserving for this step), and the
delta is what follows, tokenized alone. `before` ends with the template's end of the assistant
turn (ChatML: `<|im_end|>\\n`); the part the engine already sampled (its stop token, when it
stopped on one) is not repeated, the rest (a newline; or the whole end-of-turn when the reply
was cut at max_tokens) opens the delta. `reply` is the sampled tokens decoded, used only to
render text; the episode keeps the sampled ids.

A template that rewrites earlier turns when a message is added (one that drops reasoning from
past assistant turns, say) is refused at start by `check_prefix_preserving`, which renders
conversations of n and n+1 messages and compares, with `TemplateError` naming
`task.chat_template` and the first character where they differ.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from orchestrator.errors import ConfigError

# Conversations `check_prefix_preserving` renders: every role an episode uses, and an assistant
# turn with reasoning in it (templates that strip past reasoning rewrite exactly that).
_PROBE_REPLY = "<think>\nlet me see\n</think>\nThe answer is 4."
_PROBES: tuple[tuple[dict, ...], ...] = (
    ({"role": "user", "content": "What is 2 + 2?"},),
    ({"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}),
)
_PROBE_NEXT: tuple[tuple[dict, ...], ...] = (
    ({"role": "user", "content": "And 3 + 3?"},),
    ({"role": "tool", "content": "{\"result\": 6}"},),
)


_PLACEHOLDER = "\u2063"  # invisible separator: no template writes it on its own
# The minimal conversation a local delta is rendered after (see TurnRenderer.delta).
_CONTEXT: tuple[dict, ...] = ({"role": "user", "content": "Hi."},)
_DELTA_CACHE = 4096  # local deltas kept per renderer (cleared when full)


class TemplateError(ConfigError):
    """The chat template cannot extend an episode by appending tokens."""


class TurnRenderer:
    """Renders turns of one episode with a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer, *, field: str = "task.chat_template") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(field, "the model's tokenizer has no chat template: a multi-turn episode needs one")
        self.tokenizer = tokenizer
        self.field = field
        eos = tokenizer.eos_token_id
        self.eos_id: int | None = int(eos) if eos is not None else None
        self.eos_text: str = tokenizer.eos_token or ""
        self.local_deltas = False  # set by check_prefix_preserving
        self._deltas: dict[tuple, list[int]] = {}

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens kept. A fast tokenizer's backend decodes
        directly: transformers' own decode walks every id in Python first (most of a turn's
        cost in `inflight bench orchestrator`'s multi_turn_overhead_ratio); the same text
        unless the tokenizer cleans up spaces, which is then left to transformers."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: the template's text already holds its special tokens.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, messages: Sequence[dict]) -> list[int]:
        """The token ids of turn 1's prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def delta(self, history: Sequence[dict], sampled_ids: Sequence[int], new_messages: Sequence[dict]) -> list[int]:
        """The tokens that follow an episode whose last turn sampled `sampled_ids` (after the
        conversation `history`), to add `new_messages` and open the next assistant turn.

        With `local_deltas` (set by `check_prefix_preserving` when the template's delta was found
        not to depend on the conversation before the reply) it is rendered after a minimal
        conversation and kept per (new messages, stop): the same tokens, without rendering the
        whole history each turn (the bench's `multi_turn_overhead_ratio` measures it)."""
        stopped_on_eos = bool(sampled_ids) and self.eos_id is not None and int(sampled_ids[-1]) == self.eos_id
        if self.local_deltas:
            key = (stopped_on_eos, json.dumps(list(new_messages), sort_keys=True, default=str))
            ids = self._deltas.get(key)
            if ids is None:
                if len(self._deltas) >= _DELTA_CACHE:
                    self._deltas.clear()
                ids = self._deltas[key] = self.encode(self._delta_text(_CONTEXT, _PLACEHOLDER, new_messages,
                                                                      stopped_on_eos))
            return list(ids)
        content_ids = list(sampled_ids[:-1]) if stopped_on_eos else list(sampled_ids)
        reply = self.decode(content_ids)
        return self.encode(self._delta_text(history, reply, new_messages, stopped_on_eos))

    def _delta_text(self, history: Sequence[dict], reply: str, new_messages: Sequence[dict],
                    stopped_on_eos: bool) -> str:
        turn = [*history, {"role": "assistant", "content": reply}]
        before = self.render(turn, add_generation_prompt=False)
        after = self.render([*turn, *new_messages], add_generation_prompt=True)
        self._require_prefix(before, after, len(turn))
        tail = self._end_of_turn(history, reply, before if reply else None)
        if stopped_on_eos:
            if not tail.startswith(self.eos_text):
                raise TemplateError(self.field, f"the reply stopped on {self.eos_text!r}, but the template ends an "
                                                f"assistant turn with {tail!r}: the sampled stop token would be "
                                                "followed by text the template does not write")
            tail = tail[len(self.eos_text):]
        return tail + after[len(before):]

    def check_prefix_preserving(self) -> None:
        """Refuse (TemplateError) a template that rewrites earlier turns when one is added; and
        find whether its deltas depend on the conversation before the reply (`local_deltas`)."""
        local = True
        for first in _PROBES:
            for nxt in _PROBE_NEXT:
                for stopped in (True, False):
                    if stopped and not self.eos_text:
                        continue
                    try:
                        full = self._delta_text(first, _PROBE_REPLY, nxt, stopped)
                    except TemplateError:
                        if stopped:  # a template whose turns do not end with the EOS text
                            continue
                        raise
                    local = local and full == self._delta_text(_CONTEXT, _PLACEHOLDER, nxt, stopped)
        self.local_deltas = local

    def _require_prefix(self, before: str, after: str, n: int) -> None:
        if after.startswith(before):
            return
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        raise TemplateError(self.field, f"not prefix-preserving: rendering {n + 1} messages changes the rendering of "
                                        f"the first {n} at character {at} ({before[at:at + 40]!r} became "
                                        f"{after[at:at + 40]!r}); an episode's earlier turns would be tokenized "
                                        "again, and their sampled logprobs would no longer match their tokens")

    def _end_of_turn(self, history: Sequence[dict], reply: str, before: str | None = None) -> str:
        """What the template writes after the assistant's content: its end of turn (found with
        a placeholder when the reply is empty: an empty string is found anywhere). `before`:
        the rendering of history + the reply, when the caller has it."""
        content = reply or _PLACEHOLDER
        if before is None:
            before = self.render([*history, {"role": "assistant", "content": content}], add_generation_prompt=False)
        at = before.rfind(content)
        if at < 0:
            raise TemplateError(self.field, "the template changes the assistant's content as it renders it (the "
                                            "reply's text does not appear in the rendering)")
        return before[at + len(content):]
