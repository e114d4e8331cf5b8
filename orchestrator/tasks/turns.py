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

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: the template's text already holds its special tokens.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, messages: Sequence[dict]) -> list[int]:
        """The token ids of turn 1's prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def delta(self, history: Sequence[dict], sampled_ids: Sequence[int], new_messages: Sequence[dict]) -> list[int]:
        """The tokens that follow an episode whose last turn sampled `sampled_ids` (after the
        conversation `history`), to add `new_messages` and open the next assistant turn."""
        stopped_on_eos = bool(sampled_ids) and self.eos_id is not None and int(sampled_ids[-1]) == self.eos_id
        content_ids = list(sampled_ids[:-1]) if stopped_on_eos else list(sampled_ids)
        reply = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        turn = [*history, {"role": "assistant", "content": reply}]
        before = self.render(turn, add_generation_prompt=False)
        after = self.render([*turn, *new_messages], add_generation_prompt=True)
        self._require_prefix(before, after, len(turn))
        tail = self._end_of_turn(history, reply)
        if stopped_on_eos:
            if not tail.startswith(self.eos_text):
                raise TemplateError(self.field, f"the reply stopped on {self.eos_text!r}, but the template ends an "
                                                f"assistant turn with {tail!r}: the sampled stop token would be "
                                                "followed by text the template does not write")
            tail = tail[len(self.eos_text):]
        return self.encode(tail + after[len(before):])

    def check_prefix_preserving(self) -> None:
        """Refuse (TemplateError) a template that rewrites earlier turns when one is added."""
        for first in _PROBES:
            for nxt in _PROBE_NEXT:
                turn = [*first, {"role": "assistant", "content": _PROBE_REPLY}]
                before = self.render(turn, add_generation_prompt=False)
                after = self.render([*turn, *nxt], add_generation_prompt=True)
                self._require_prefix(before, after, len(turn))
                self._end_of_turn(first, _PROBE_REPLY)

    def _require_prefix(self, before: str, after: str, n: int) -> None:
        if after.startswith(before):
            return
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        raise TemplateError(self.field, f"not prefix-preserving: rendering {n + 1} messages changes the rendering of "
                                        f"the first {n} at character {at} ({before[at:at + 40]!r} became "
                                        f"{after[at:at + 40]!r}); an episode's earlier turns would be tokenized "
                                        "again, and their sampled logprobs would no longer match their tokens")

    def _end_of_turn(self, history: Sequence[dict], reply: str) -> str:
        """What the template writes after the assistant's content: its end of turn (found with
        a placeholder when the reply is empty: an empty string is found anywhere)."""
        content = reply or _PLACEHOLDER
        before = self.render([*history, {"role": "assistant", "content": content}], add_generation_prompt=False)
        at = before.rfind(content)
        if at < 0:
            raise TemplateError(self.field, "the template changes the assistant's content as it renders it (the "
                                            "reply's text does not appear in the rendering)")
        return before[at + len(content):]
