"""The toy tasks: deterministic prompts, the digits and length rewards."""

from __future__ import annotations

import pytest

from orchestrator.config.run import TaskConfig
from orchestrator.errors import ConfigError
from orchestrator.tasks import DigitsTask, LengthTask, Prompt, make_task

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


async def test_prompts_are_deterministic_in_seed_and_index_and_chat_templated(tokenizer, tiny_model_dir):
    task = make_task(TaskConfig(name="digits", seed=3), str(tiny_model_dir))
    again = DigitsTask(tokenizer, TaskConfig(name="digits", seed=3))
    other = DigitsTask(tokenizer, TaskConfig(name="digits", seed=4))
    first = [await task.prompt(i) for i in range(20)]
    # Resuming at index 17 draws what the uninterrupted run drew.
    assert await again.prompt(17) == first[17]
    assert [p.text for p in first] != [(await other.prompt(i)).text for i in range(20)]
    assert len({p.text for p in first}) > 10
    p = first[17]
    assert p.prompt_id == "digits-s3-000017" and p.index == 17 and p.target is None
    assert p.text.startswith("Write digits: ") and all(d.isdigit() for d in p.text.split(": ")[1].split())
    assert tokenizer.decode(list(p.token_ids)) == f"<|im_start|>user\n{p.text}<|im_end|>\n<|im_start|>assistant\n"
    assert isinstance(p.token_ids, tuple)
    with pytest.raises(ValueError):
        await task.prompt(-1)


async def test_digits_reward_is_the_share_of_digit_tokens_and_eos_is_not_a_digit(tokenizer):
    task = DigitsTask(tokenizer, TaskConfig(name="digits"))
    prompt = await task.prompt(0)
    digit = _ids(tokenizer, "7")
    word = _ids(tokenizer, "def")
    assert len(digit) == 1 and len(word) == 1
    eos = tokenizer.eos_token_id
    assert (await task.score(prompt, digit * 3))["reward"] == 1.0
    assert (await task.score(prompt, digit * 3 + [eos]))["reward"] == 0.75
    assert (await task.score(prompt, digit + word))["reward"] == 0.5
    assert (await task.score(prompt, []))["reward"] == 0.0
    multi = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) in ("00", "10", "99")]
    assert multi and (await task.score(prompt, multi))["reward"] == 1.0  # multi-digit tokens count
    space_digit = _ids(tokenizer, " 5")
    if len(space_digit) == 1:  # " 5" as one token decodes with a space: not all digits
        assert (await task.score(prompt, space_digit))["reward"] == 0.0


async def test_length_reward_counts_tokens_without_the_final_eos(tokenizer):
    task = LengthTask(tokenizer, TaskConfig(name="length", seed=1, length_min=4, length_max=12))
    prompts = [await task.prompt(i) for i in range(50)]
    assert {p.target for p in prompts} <= set(range(4, 13)) and len({p.target for p in prompts}) > 4
    assert all(str(p.target) in p.text for p in prompts)
    p = Prompt(prompt_id="x", index=0, text="Write exactly 8 tokens.", token_ids=(1,), target=8)
    eos = tokenizer.eos_token_id
    word = _ids(tokenizer, "def")[0]
    assert (await task.score(p, [word] * 8))["reward"] == 1.0
    assert (await task.score(p, [word] * 8 + [eos]))["reward"] == 1.0
    assert (await task.score(p, [word] * 6 + [eos]))["reward"] == pytest.approx(0.75)
    assert (await task.score(p, [word] * 10))["reward"] == pytest.approx(0.75)
    assert (await task.score(p, []))["reward"] == 0.0
    assert (await task.score(p, [eos, word]))["reward"] == pytest.approx(0.25)  # an EOS not at the end counts


def test_make_task_rejects_an_unknown_name(tiny_model_dir):
    import msgspec

    bad = msgspec.structs.replace(TaskConfig(), name="chess")
    with pytest.raises(ConfigError, match="task.name"):
        make_task(bad, str(tiny_model_dir))
