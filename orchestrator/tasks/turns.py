"""Token in, token out across the turns of an episode (issue #19): the prompt of turn k+1 is
the episode's exact token sequence so far (every prompt and sampled token, as the engine saw
and produced them) plus the tokens of the chat template's *delta* for the new messages; no
earlier turn is ever tokenized again.

The delta comes from rendering text, never from re-tokenizing the past:

    before = render(history + [assistant(reply)], add_generation_prompt=False)
    after  = render(history + [assistant(reply)] + new_messages, add_generation_prompt=True)

`after` must agree with `before` up to the end of the reply (the template is prefix-preserving
for this step; what `before` writes after the reply may differ, e.g. Phi-3's end-of-conversation
eos), and the delta is what follows the reply in `after`, tokenized alone: the template's end of
the assistant turn (ChatML: `<|im_end|>\\n`), the new messages, the opening of the next turn.
When the engine ended the turn on a stop id (`stop_ids`: every id the engine stops on, see
`templates.engine_stop_ids`), that sampled token stands for the template's end of turn, which
is then left out of the delta: a turn that stopped on `<|endoftext|>` (Qwen2.5's second eos) is
not followed by a second end of turn; one cut at max_tokens gets the whole end of turn. `reply`
is the sampled tokens decoded, used only to render text; the episode keeps the sampled ids.

A template that rewrites earlier turns when a message is added (one that drops reasoning from
past assistant turns, say) is refused at start by `check_prefix_preserving`, which renders
conversations of n and n+1 messages with the roles the task sends and compares; the
`TemplateError` names the field and says what to do (a path to a prefix-preserving template).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from orchestrator.tasks.byte_text import ByteText
from orchestrator.tasks.templates import TemplateError, TemplateRaised, template_errors

__all__ = ["TemplateError", "TemplateRaised", "TurnRenderer"]

# The reply of every probe `check_prefix_preserving` renders: reasoning in it (templates that
# strip past reasoning rewrite exactly that).
_PROBE_REPLY = "<think>\nlet me see\n</think>\nThe answer is 4."
_USER = {"role": "user", "content": "What is 2 + 2?"}
_SYSTEM = {"role": "system", "content": "You are terse."}
_EARLIER = ({"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": _PROBE_REPLY})
_NEXT_USER = {"role": "user", "content": "And 3 + 3?"}
_NEXT_TOOL = {"role": "tool", "content": "{\"result\": 6}"}


_PLACEHOLDER = "\u2063"  # invisible separator: no template writes it on its own
# The minimal conversation a local delta is rendered after (see TurnRenderer.delta).
_CONTEXT: tuple[dict, ...] = ({"role": "user", "content": "Hi."},)
_DELTA_CACHE = 4096  # local deltas kept per renderer (cleared when full)


class TurnRenderer:
    """Renders turns of one episode with a Hugging Face tokenizer's chat template.

    `field`: the setting named by its errors; `source`: the template's name in them;
    `stop_ids`: every token id the engine ends a turn on (default: the tokenizer's eos)."""

    def __init__(self, tokenizer, *, field: str = "task.chat_template", source: str = "the model's chat template",
                 stop_ids: Iterable[int] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(field, "the model's tokenizer has no chat template: a multi-turn episode needs one")
        self.tokenizer = tokenizer
        self.field = field
        self.source = source
        eos = tokenizer.eos_token_id
        self.eos_id: int | None = int(eos) if eos is not None else None
        default = () if self.eos_id is None else (self.eos_id,)
        self.stop_ids: frozenset[int] = frozenset(int(t) for t in (default if stop_ids is None else stop_ids))
        self._byte_text = ByteText.of(tokenizer)  # None: not byte-level BPE, the tokenizer decodes
        # Each stop token's text, longest first: the end of turn a sampled stop stands for.
        texts = {self.decode([t]) for t in self.stop_ids}
        self._stop_texts = sorted((t for t in texts if t), key=len, reverse=True)
        self.local_deltas = False  # set by check_prefix_preserving
        self._local_roles: frozenset[str] = frozenset()  # the roles whose deltas were found local
        self._deltas: dict[tuple, list[int]] = {}

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        with template_errors(self.field, self.source, messages):
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens kept. A fast tokenizer's backend decodes
        directly: transformers' own decode walks every id in Python first (most of a turn's
        cost in `inflight bench orchestrator`'s multi_turn_overhead_ratio); the same text
        unless the tokenizer cleans up spaces, which is then left to transformers. A byte-level
        BPE tokenizer's text comes from its table of each token's bytes (`byte_text.py`: the same
        text, a third of the time)."""
        if self._byte_text is not None:
            text = self._byte_text.decode(ids)
            if text is not None:
                return text
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            # decode_batch, not decode: the same text, and it lets go of the GIL while it decodes
            # (decode holds it), so the run's loop goes on in the meantime.
            return backend.decode_batch([list(ids)], skip_special_tokens=False)[0]
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """The token ids of text (add_special_tokens=False: the template's text already holds its
        special tokens). A fast tokenizer's backend encodes directly when transformers would
        hand it the text as it is (no truncation or padding set on it, special tokens not split):
        half the cost of transformers' call, and encode_batch lets go of the GIL meanwhile."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if (backend is not None and backend.truncation is None and backend.padding is None
                and not getattr(self.tokenizer, "split_special_tokens", False)):
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, messages: Sequence[dict]) -> list[int]:
        """The token ids of turn 1's prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def ended_on_stop(self, sampled_ids: Sequence[int]) -> bool:
        """Whether the turn's last token is one the engine stops on."""
        return bool(sampled_ids) and int(sampled_ids[-1]) in self.stop_ids

    def reply_ids(self, sampled_ids: Sequence[int]) -> list[int]:
        """The reply's own tokens: the sampled ones without the stop token that ended them."""
        return list(sampled_ids[:-1]) if self.ended_on_stop(sampled_ids) else list(sampled_ids)

    def delta(self, history: Sequence[dict], sampled_ids: Sequence[int], new_messages: Sequence[dict]) -> list[int]:
        """The tokens that follow an episode whose last turn sampled `sampled_ids` (after the
        conversation `history`), to add `new_messages` and open the next assistant turn.

        With `local_deltas` (set by `check_prefix_preserving` when the template's delta was found
        not to depend on the conversation before the reply, for the roles it probed) it is
        rendered after a minimal conversation and kept per (new messages, stop): the same
        tokens, without rendering the whole history each turn (the bench's
        `multi_turn_overhead_ratio` measures it)."""
        stopped = self.ended_on_stop(sampled_ids)
        if self.local_deltas and all(m.get("role") in self._local_roles for m in new_messages):
            key = (stopped, json.dumps(list(new_messages), sort_keys=True, default=str))
            ids = self._deltas.get(key)
            if ids is None:
                if len(self._deltas) >= _DELTA_CACHE:
                    self._deltas.clear()
                ids = self._deltas[key] = self.encode(self._delta_text(_CONTEXT, "", new_messages, stopped))
            return list(ids)
        reply = self.decode(self.reply_ids(sampled_ids))
        return self.encode(self._delta_text(history, reply, new_messages, stopped))

    def _delta_text(self, history: Sequence[dict], reply: str, new_messages: Sequence[dict], stopped: bool) -> str:
        rest = self._after_reply(history, reply, new_messages)
        if not stopped:
            return rest
        after_stop = self._after_stop(rest)
        if after_stop is None:
            raise TemplateError(self.field, f"the reply ended on a stop token ({', '.join(map(repr, self._stop_texts))}"
                                            f"), but {self.source} follows an assistant's reply with {rest[:40]!r}: "
                                            "the sampled stop token would be followed by text the template does "
                                            "not write after one")
        return after_stop

    def _after_reply(self, history: Sequence[dict], reply: str, new_messages: Sequence[dict]) -> str:
        """What the template writes after the reply's content when `new_messages` follow it and
        the next assistant turn opens. The content is rendered with a placeholder after it,
        which marks where it ends (a reply may also occur in the text after it, say "\\n")."""
        marked = reply + _PLACEHOLDER
        turn = [*history, {"role": "assistant", "content": marked}]
        before = self.render(turn, add_generation_prompt=False)
        after = self.render([*turn, *new_messages], add_generation_prompt=True)
        end = before.rfind(_PLACEHOLDER)
        if end < 0 or not before[:end].endswith(reply):
            raise TemplateError(self.field, f"{self.source} changes the assistant's content as it renders it (the "
                                            "reply's text does not appear in the rendering): an episode's sampled "
                                            "tokens would not be what the template renders")
        self._require_prefix(before[:end], after, len(turn))
        return after[end + len(_PLACEHOLDER):]

    def _after_stop(self, rest: str) -> str | None:
        """`rest` without the template's end of turn, which a sampled stop token stands for;
        None when `rest` does not start with a stop token's text."""
        for text in self._stop_texts:
            if rest.startswith(text):
                return rest[len(text):]
        return None

    def check_prefix_preserving(self, sends: Iterable[str] = ("system", "tool"), may_send: Iterable[str] = ()) -> None:
        """Refuse (TemplateError) a template that rewrites earlier turns when one is added, or
        that raises on a role the task `sends` (besides user and assistant); and find whether
        its deltas depend on the conversation before the reply (`local_deltas`). A role the
        task `may_send` is probed where the template renders it: one it refuses is left to
        the episode that sends it (which then errors with the template's message)."""
        sends = frozenset(sends)
        maybe = frozenset(may_send) - sends
        local, answered = True, set()
        for first, nxt in _probes(sends | maybe):
            try:
                rest = self._after_reply(first, _PROBE_REPLY, nxt)
            except TemplateRaised:
                if {m["role"] for m in (*first, *nxt)} & maybe:  # a role the task may never send
                    continue
                raise
            answered |= {m["role"] for m in nxt}
            local = local and rest == self._after_reply(_CONTEXT, "", nxt)
        self.local_deltas = local
        self._local_roles = frozenset(answered)

    def _require_prefix(self, before: str, after: str, n: int) -> None:
        if after.startswith(before):
            return
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        raise TemplateError(self.field, f"{self.source} is not prefix-preserving: rendering {n + 1} messages changes "
                                        f"the rendering of the first {n} at character {at} ({before[at:at + 40]!r} "
                                        f"became {after[at:at + 40]!r}); an episode's earlier turns would be "
                                        "tokenized again, and their sampled logprobs would no longer match their "
                                        f"tokens. Give {self.field} the path of a Jinja file with a prefix-preserving "
                                        "variant of the template (one that renders every earlier turn as it was "
                                        "sampled, past <think> blocks included)")


def _probes(roles: frozenset[str]) -> list[tuple[tuple[dict, ...], tuple[dict, ...]]]:
    """(conversation, next messages) pairs with the roles a task sends: a user message alone,
    after a system message, after an earlier exchange; answered by a user or a tool message."""
    firsts: list[tuple[dict, ...]] = [(_USER,), (*_EARLIER, _USER)]
    if "system" in roles:
        firsts.append((_SYSTEM, _USER))
    nexts: list[tuple[dict, ...]] = [(_NEXT_USER,)]
    if "tool" in roles:
        nexts.append((_NEXT_TOOL,))
    return [(first, nxt) for first in firsts for nxt in nexts]
