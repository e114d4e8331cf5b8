"""Token in, token out across turns (orchestrator/tasks/turns.py) with the local model's own
tokenizer and ChatML template: the episode's tokens plus each delta are exactly the template's
rendering of the whole conversation; a template that rewrites earlier turns is refused."""

from __future__ import annotations

import pytest

from orchestrator.tasks.turns import TemplateError, TurnRenderer

# Qwen3's way with reasoning: past assistant turns lose their <think> block.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1].lstrip() + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_episode_plus_each_delta_is_the_rendering_of_the_whole_conversation(tokenizer):
    r = TurnRenderer(tokenizer)
    r.check_prefix_preserving()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    episode = r.first_prompt(history)
    for reply, new in (("It is 4.", {"role": "user", "content": "And 3 + 3?"}),
                       ("6", {"role": "tool", "content": "{\"ok\": true}"})):
        sampled = r.encode(reply) + [tokenizer.eos_token_id]  # what the engine returns: the reply, its stop token
        episode += sampled + r.delta(history, sampled, [new])
        history += [{"role": "assistant", "content": reply}, new]
        assert episode == r.encode(r.render(history, add_generation_prompt=True))


def test_earlier_tokens_are_never_tokenized_again(tokenizer):
    """A reply sampled as tokens the tokenizer would not choose for its text stays as sampled."""
    r = TurnRenderer(tokenizer)
    history = [{"role": "user", "content": "spell it"}]
    prompt = r.first_prompt(history)
    odd = [tokenizer.convert_tokens_to_ids(c) for c in "hello"]  # one token per letter
    assert odd != r.encode("hello")
    sampled = odd + [tokenizer.eos_token_id]
    delta = r.delta(history, sampled, [{"role": "user", "content": "again"}])
    whole = r.render(history + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
                     add_generation_prompt=True)
    assert tokenizer.decode(prompt + sampled + delta) == whole
    assert (prompt + sampled + delta)[:len(prompt) + len(sampled)] == prompt + sampled


def test_a_reply_cut_at_max_tokens_is_closed_by_the_delta(tokenizer):
    r = TurnRenderer(tokenizer)
    history = [{"role": "user", "content": "count"}]
    sampled = r.encode("1 2 3")  # no stop token: cut at max_tokens
    delta = r.delta(history, sampled, [{"role": "user", "content": "go on"}])
    assert delta[0] == tokenizer.eos_token_id, "the end of turn the model did not sample opens the delta"
    episode = r.first_prompt(history) + sampled + delta
    assert episode == r.encode(r.render(history + [{"role": "assistant", "content": "1 2 3"},
                                                   {"role": "user", "content": "go on"}], add_generation_prompt=True))


def test_an_empty_reply_is_an_end_of_turn_alone(tokenizer):
    r = TurnRenderer(tokenizer)
    history = [{"role": "user", "content": "say nothing"}]
    delta = r.delta(history, [tokenizer.eos_token_id], [{"role": "user", "content": "ok"}])
    assert tokenizer.decode(delta) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_field(tokenizer):
    import copy

    stripping = copy.deepcopy(tokenizer)
    stripping.chat_template = STRIPPING_TEMPLATE
    with pytest.raises(TemplateError) as err:
        TurnRenderer(stripping).check_prefix_preserving()
    assert err.value.field == "task.chat_template" and "not prefix-preserving" in str(err.value)
    assert "<think>" in str(err.value)


def test_a_tokenizer_without_a_template_is_refused(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        TurnRenderer(bare)


def test_encode_is_transformers_own_and_leaves_a_truncating_tokenizer_to_it(tokenizer):
    import copy

    r = TurnRenderer(tokenizer)
    texts = ["", "hello", "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n",
             "  spaces\tand\nlines  ", "ünïcödé 数字 12 34", "<|im_end|><|im_end|>x"]
    for text in texts:  # the backend's own encoding, the same ids transformers gives
        assert r.encode(text) == list(tokenizer(text, add_special_tokens=False)["input_ids"]), text
    cut = copy.deepcopy(tokenizer)
    cut.backend_tokenizer.enable_truncation(max_length=3)  # left set by some earlier call of its owner
    long = "1 2 3 4 5 6 7 8"
    assert cut.backend_tokenizer.encode(long, add_special_tokens=False).ids != r.encode(long)
    assert TurnRenderer(cut).encode(long) == r.encode(long)  # transformers' call, not the truncating backend
