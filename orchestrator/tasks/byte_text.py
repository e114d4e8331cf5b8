"""A byte-level BPE tokenizer's text, from a table of each token's bytes.

Byte-level BPE (GPT-2's scheme: Qwen, Llama 3, GPT-NeoX, ...) writes each token as the bytes it
stands for, spelled in a 256-character alphabet; the `tokenizers` library's `ByteLevel` decoder
maps every token back to its bytes (a token with a character outside that alphabet, an added
token such as `<|im_end|>`, to its own UTF-8), joins them, and decodes the whole as UTF-8 with
U+FFFD for what is not valid. The same, from a table of each id's bytes built once, is a gather,
a join and one `bytes.decode`: ~10 us for a 500-token reply against `tokenizers`' ~46 us (its
decoder builds a string per token first). An episode decodes every reply for its environment
(`env._after_the_reply`); on `inflight bench orchestrator`'s zero-latency engine the
environment's thread does that for every episode of a turn at once while the run's loop waits
(`multi_turn_overhead_ratio`).

`ByteText.of(tokenizer)` gives one only where it is the same function: the decoder is
`ByteLevel` itself (not a sequence with more steps), every id's text from the table matches
`tokenizers`' own, and so do sequences that split characters across tokens. Anything else is
None, and the tokenizer decodes as before. An id the table has no bytes for (negative, outside
the vocabulary, a gap in it) makes `decode` return None for that call: the tokenizer decides.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from operator import itemgetter

_CHECK_SEQUENCES = 256  # random sequences compared at build (ids that split characters, added tokens)
_CHECK_LENGTH = 48


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted: character -> the byte it spells."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _token_bytes(token: str, alphabet: dict[str, int]) -> bytes:
    # As tokenizers' ByteLevel decoder: a token wholly in the alphabet is the bytes it spells,
    # any other (an added token's content) its own UTF-8.
    try:
        return bytes([alphabet[c] for c in token])
    except KeyError:
        return token.encode("utf-8")


class ByteText:
    """The text of token ids (special tokens kept), for a tokenizer `of` accepts."""

    def __init__(self, table: tuple[bytes | None, ...]) -> None:
        # A dict, not the tuple: an id it does not hold (negative, past the vocabulary, a gap in
        # it) is a KeyError, where a tuple would read a negative id from its end.
        self._bytes: dict[int, bytes] = {i: b for i, b in enumerate(table) if b is not None}

    @classmethod
    def of(cls, tokenizer) -> ByteText | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        try:
            from tokenizers import decoders
        except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
            return None
        if type(backend.decoder) is not decoders.ByteLevel:
            return None
        alphabet = _byte_alphabet()
        size = backend.get_vocab_size(with_added_tokens=True)
        tokens = [backend.id_to_token(i) for i in range(size)]
        table = tuple(None if t is None else _token_bytes(t, alphabet) for t in tokens)
        text = cls(table)
        return text if text._agrees_with(backend) else None

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of `ids`, or None where an id has no bytes here (the caller asks the tokenizer)."""
        table = self._bytes
        try:
            # itemgetter gathers the ids' bytes in C: a third of the time of a comprehension.
            parts = itemgetter(*ids)(table) if len(ids) > 1 else [table[i] for i in ids]
            return b"".join(parts).decode("utf-8", "replace")
        except (KeyError, TypeError):  # an id outside the vocabulary (or a gap in it), not an int
            return None

    def _agrees_with(self, backend) -> bool:
        """Every id alone, then random sequences, decoded here and by `tokenizers`: the same text."""
        ids = list(self._bytes)
        if not ids:
            return False
        singles = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        if any(self.decode([i]) != text for i, text in zip(ids, singles)):
            return False
        rng = random.Random(0)
        # Many ids of a byte-level vocabulary are single bytes (the first 256 merges' inputs):
        # sampling among them splits multi-byte characters, the case where joining matters.
        short = [i for i in ids if len(self._bytes[i]) == 1] or ids
        sequences = [[rng.choice(short if rng.random() < 0.5 else ids) for _ in range(rng.randrange(1, _CHECK_LENGTH))]
                     for _ in range(_CHECK_SEQUENCES)]
        decoded = backend.decode_batch(sequences, skip_special_tokens=False)
        return all(self.decode(s) == text for s, text in zip(sequences, decoded))
