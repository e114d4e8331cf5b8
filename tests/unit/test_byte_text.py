"""A byte-level BPE tokenizer's text from its table of token bytes (orchestrator/tasks/byte_text.py,
issue #32 item 2): the same text as `tokenizers` gives, special and added tokens kept, characters
split across tokens and bytes that are not UTF-8 included; anything the table cannot answer (a
tokenizer of another kind, an id outside the vocabulary) goes to the tokenizer. The tokenizer is
the local tiny-rl one (byte-level BPE), with tokens added the way users add them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from orchestrator.tasks.byte_text import ByteText
from orchestrator.tasks.turns import TurnRenderer

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-rl"

pytestmark = [pytest.mark.usefixtures("checkout_rl_model"), pytest.mark.light_lane]


def tiny_rl(**added):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    if added.get("special"):
        tokenizer.add_special_tokens({"additional_special_tokens": added["special"]})
    if added.get("plain"):
        tokenizer.add_tokens(added["plain"])
    return tokenizer


def backend_text(tokenizer, ids) -> str:
    return tokenizer.backend_tokenizer.decode(list(ids), skip_special_tokens=False)


def single_byte_ids(tokenizer, text: ByteText) -> dict[int, int]:
    """byte -> the id of the token that is that byte alone."""
    return {b[0]: i for i, b in text._bytes.items() if len(b) == 1}


def test_random_sequences_read_as_the_tokenizers_own_text():
    tokenizer = tiny_rl()
    text = ByteText.of(tokenizer)
    assert text is not None
    rng = random.Random(7)
    vocab = len(tokenizer)
    for _ in range(500):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 80))]
        assert text.decode(ids) == backend_text(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("raw", [
    "héllo wörld ✓ 数学 🙂".encode(),   # 2-, 3- and 4-byte characters
    b"\xe2\x82",                          # a character cut at the end of the reply
    b"ab\xe2\x82cd",                      # ... in the middle
    b"\x80\x80abc",                       # continuation bytes alone
    b"\xc0\xaf",                          # an overlong encoding
    b"\xed\xa0\x80",                      # a surrogate
    b"\xf4\x90\x80\x80",                  # past U+10FFFF
    b"\xf0\x9f\x99",                      # a 4-byte character missing its last byte
    b"\xff\xfe\x00x",                     # bytes UTF-8 never uses
])
def test_bytes_that_split_or_break_characters_read_as_the_tokenizer_reads_them(raw):
    tokenizer = tiny_rl()
    text = ByteText.of(tokenizer)
    ids = [single_byte_ids(tokenizer, text)[b] for b in raw]
    assert text.decode(ids) == backend_text(tokenizer, ids)
    assert text.decode(ids) == raw.decode("utf-8", "replace")


def test_added_tokens_special_or_not_with_characters_outside_the_byte_alphabet():
    # "<tool call>" has a space (not in the byte alphabet: its own UTF-8); "Ġok" is spelled in
    # the alphabet (the decoder reads it as " ok"), "<|im_end|>"-style specials as they are.
    tokenizer = tiny_rl(special=["<|tool|>", "<end turn>"], plain=["<tool call>", "Ġok", "数"])
    text = ByteText.of(tokenizer)
    assert text is not None
    added = [tokenizer.convert_tokens_to_ids(t) for t in ("<|tool|>", "<end turn>", "<tool call>", "Ġok", "数")]
    assert text.decode(added) == "<|tool|><end turn><tool call> ok数"
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.choice(added) if rng.random() < 0.3 else rng.randrange(len(tokenizer)) for _ in range(30)]
        assert text.decode(ids) == backend_text(tokenizer, ids)


def test_an_id_outside_the_vocabulary_is_left_to_the_tokenizer():
    tokenizer = tiny_rl()
    text = ByteText.of(tokenizer)
    vocab = len(tokenizer)
    assert text.decode([5, vocab + 3]) is None  # an engine's padded vocabulary can sample one
    assert text.decode([5, -1]) is None  # never read from the table's end
    # Every negative id, however far below (a tuple's index would wrap to a real token):
    assert all(text.decode([5, -k]) is None for k in (1, 2, vocab - 1, vocab, vocab + 1, 2 * vocab, 2 * vocab + 5))
    assert text.decode([-1]) is None and text.decode([-vocab - 1]) is None
    assert text.decode([]) == "" and text.decode([5]) == backend_text(tokenizer, [5])
    renderer = TurnRenderer(chatml(tokenizer))
    # The renderer falls back: the tokenizer drops ids it has no token for.
    assert renderer.decode([5, vocab + 3]) == backend_text(tokenizer, [5])


def test_a_table_that_disagrees_with_the_tokenizer_is_not_used():
    tokenizer = tiny_rl()
    text = ByteText.of(tokenizer)
    table = [text._bytes.get(i) for i in range(len(tokenizer))]
    table[300] = table[300] + b"!"  # one token's bytes wrong
    assert not ByteText(tuple(table))._agrees_with(tokenizer.backend_tokenizer)


def test_other_decoders_and_space_clean_up_are_left_to_the_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "hello": 3}
    sentencepiece_like = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    sentencepiece_like.pre_tokenizer = pre_tokenizers.Metaspace()
    sentencepiece_like.decoder = decoders.Metaspace()
    assert ByteText.of(PreTrainedTokenizerFast(tokenizer_object=sentencepiece_like)) is None
    cleaning = tiny_rl()
    cleaning.clean_up_tokenization_spaces = True  # transformers rewrites the text after the decoder
    assert ByteText.of(cleaning) is None


def test_the_turn_renderer_reads_replies_through_the_table():
    tokenizer = chatml(tiny_rl())
    renderer = TurnRenderer(tokenizer)
    assert renderer._byte_text is not None
    ids = tokenizer.encode("The answer is 4. ✓<|im_end|>", add_special_tokens=False)
    assert renderer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False) == "The answer is 4. ✓<|im_end|>"


def chatml(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                               "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                               "{{ '<|im_start|>assistant\n' }}{% endif %}")
    return tokenizer
