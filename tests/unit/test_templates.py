"""Templates and stop tokens (#30 item 4; orchestrator/tasks/templates.py, turns.py): the turn
renderer knows every token id the engine stops on, so a turn that ended on any of them is not
followed by a second end of turn; a template that raises is a TemplateError naming the field with
the template's own message; the start-up probe sends only the roles the task sends; and
`task.chat_template` takes a path to a Jinja template (a prefix-preserving variant of a thinking
template).

The tokenizers are the local tiny-rl tokenizer, saved again with another model family's chat
template, special tokens and generation_config.json: a Qwen2.5-style directory (`<|im_end|>`
ends a turn, `<|endoftext|>` is a second eos), a Phi-3-style one (`<|end|>` ends a turn, the
tokenizer's eos is `<|endoftext|>`, and the template writes an eos after the last message when
no generation prompt follows), a Gemma-style one (no system or tool role, strict alternation).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.run import TaskConfig
from orchestrator.errors import ConfigError
from orchestrator.tasks import make_task
from orchestrator.tasks.env import SampledTurn, run_episode
from orchestrator.tasks.templates import engine_stop_ids
from orchestrator.tasks.turns import TurnRenderer
from replay.records import SamplingSettings

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-rl"
DIALOGUE = "orchestrator.tasks.toy_env:digits_dialogue"  # user messages only, no tools
CALCULATOR = "orchestrator.tasks.toy_env:calculator"  # a system message and an add tool

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# microsoft/Phi-3-mini-4k-instruct's template, as it is.
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
# Gemma-2's, without its bos_token.
GEMMA = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
         "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
# A thinking template (Qwen3's way): assistant turns before the last user message lose their
# <think> block. THINKING_KEPT is the user's prefix-preserving variant: every turn as it was.
_LAST_USER = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
              "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}")
_TURN = "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
_GENERATION = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
THINKING = (_LAST_USER + "{% for m in messages %}{% if m['role'] == 'assistant' and loop.index0 < ns.last %}"
            "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1].lstrip() + '<|im_end|>\n' }}"
            "{% else %}" + _TURN + "{% endif %}{% endfor %}" + _GENERATION)
THINKING_KEPT = "{% for m in messages %}" + _TURN + "{% endfor %}" + _GENERATION


def tokenizer_dir(out: Path, template: str, generation_eos: list[str], *, eos: str | None = None,
                  special: tuple[str, ...] = ()) -> Path:
    """The tiny-rl tokenizer saved at `out` with `template`, extra special tokens, another eos,
    and a generation_config.json whose eos_token_id is `generation_eos` (an int when one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    added: dict = {"additional_special_tokens": list(special)} if special else {}
    if eos is not None:
        added["eos_token"] = eos
    if added:
        tokenizer.add_special_tokens(added)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in generation_eos]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids if len(ids) > 1 else ids[0]}))
    return out


STYLES = {
    # (template, generation_config eos, tokenizer eos, special tokens, the template's end of turn)
    "qwen2.5": (CHATML, ["<|im_end|>", "<|endoftext|>"], None, (), "<|im_end|>"),
    "phi-3": (PHI3, ["<|endoftext|>", "<|assistant|>", "<|end|>"], "<|endoftext|>",
              ("<|end|>", "<|user|>", "<|assistant|>", "<|system|>"), "<|end|>"),
    "gemma": (GEMMA, ["<|endoftext|>", "<end_of_turn>"], "<|endoftext|>", ("<start_of_turn>", "<end_of_turn>"),
              "<end_of_turn>"),
}


@pytest.fixture(scope="module")
def styled(tmp_path_factory):
    """style -> a tokenizer directory of that model family."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: tokenizer_dir(root / name, template, gen_eos, eos=eos, special=special)
            for name, (template, gen_eos, eos, special, _) in STYLES.items()}


def load(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Replies:
    """The engine, scripted: each turn is `text` then the next of `stops` (the stop id the
    engine ended it on); records every prompt it was given."""

    def __init__(self, renderer: TurnRenderer, texts: list[str], stops: list[int]) -> None:
        self.r, self.texts, self.stops = renderer, list(texts), list(stops)
        self.prompts: list[list[int]] = []

    async def __call__(self, prompt, max_new):
        self.prompts.append(list(prompt))
        ids = self.r.encode(self.texts.pop(0)) + [self.stops.pop(0)]
        return SampledTurn(ids, [-0.5] * len(ids), [(0, 0)], "stop")


def stop_runs(ids: list[int], stops: frozenset[int]) -> list[int]:
    """Positions where a stop token directly follows another: a doubled end of turn."""
    return [i for i in range(1, len(ids)) if ids[i] in stops and ids[i - 1] in stops]


# -- 1. every stop id the engine uses ------------------------------------------------------------
def test_the_stop_ids_are_the_tokenizers_eos_the_generation_configs_and_the_runs(styled):
    qwen, phi = load(styled["qwen2.5"]), load(styled["phi-3"])
    im_end, endoftext = qwen.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert qwen.eos_token_id == im_end
    assert engine_stop_ids(qwen, styled["qwen2.5"]) == {im_end, endoftext}
    end, assistant = phi.convert_tokens_to_ids(["<|end|>", "<|assistant|>"])
    assert engine_stop_ids(phi, styled["phi-3"]) == {phi.eos_token_id, assistant, end}
    seven = qwen.convert_tokens_to_ids("7")
    assert engine_stop_ids(qwen, styled["qwen2.5"], SamplingSettings(stop_token_ids=(seven,))) == \
        {im_end, endoftext, seven}
    # vLLM ignores every eos with ignore_eos; the run's own stop ids still stop it
    assert engine_stop_ids(qwen, styled["qwen2.5"], SamplingSettings(stop_token_ids=(seven,), ignore_eos=True)) == \
        {seven}
    assert engine_stop_ids(qwen, MODEL) == {im_end}  # an int eos_token_id (tiny-rl's own)


@pytest.mark.parametrize("style", ["qwen2.5", "phi-3", "gemma"])
async def test_a_turn_that_ended_on_either_stop_id_is_followed_by_one_end_of_turn(styled, style):
    """Turn 1 stops on the template's end of turn, turn 2 on the other eos: the context holds
    each message's end once, and with the sampled stop read as the template's end of turn it is
    the template's rendering of the conversation."""
    task = make_task(TaskConfig(entrypoint=DIALOGUE, args={"turns": 3}), str(styled[style]))
    r = task.renderer
    eot = r.tokenizer.convert_tokens_to_ids(STYLES[style][4])
    other = next(t for t in r.stop_ids if t != eot and r.tokenizer.convert_ids_to_tokens(t) != "<|assistant|>")
    replies = Replies(r, ["7 7", "8", "9"], [eot, other, eot])
    episode = await run_episode(task.runner.env, r, replies, {"index": 0}, max_tokens_per_turn=16)
    assert episode.turns == 3
    context = episode.next_prompt()
    for before, after in zip(replies.prompts, replies.prompts[1:]):
        assert after[:len(before)] == before, "every turn's prompt extends the previous one"
    closers = frozenset({eot, other})
    assert stop_runs(context, closers) == [], r.tokenizer.decode(context)
    ends = sum(t in closers for t in context)
    assert ends == len(episode.messages), "every message (the last reply too) is closed exactly once"
    as_template = [eot if t in closers else t for t in replies.prompts[-1]]
    assert r.tokenizer.decode(as_template) == r.render(episode.messages[:5], add_generation_prompt=True)
    assert [m["content"] for m in episode.messages if m["role"] == "assistant"] == ["7 7", "8", "9"]

    # The property fails where the renderer knows the tokenizer's eos alone (the engine's other
    # stops unknown): the stop it does not know is followed by the template's end of turn.
    alone = TurnRenderer(r.tokenizer, stop_ids=[r.tokenizer.eos_token_id])
    alone.check_prefix_preserving((), ())
    unknown = other if r.tokenizer.eos_token_id == eot else eot
    replies = Replies(alone, ["7", "8", "9"], [unknown, unknown, unknown])
    episode = await run_episode(task.runner.env, alone, replies, {"index": 0}, max_tokens_per_turn=16)
    assert stop_runs(episode.next_prompt(), closers) != []


# -- 2. a template that raises is named -----------------------------------------------------------
def test_a_template_that_raises_is_refused_naming_the_field_with_its_own_message(styled, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "2 + 2?", "answer": "4"}) + "\n")
    config = TaskConfig(dataset=str(rows), system_prompt="Be brief.", rewards=[{"fn": "exact"}])
    with pytest.raises(ConfigError) as refused:
        make_task(config, str(styled["gemma"]))
    assert refused.value.field == "task.chat_template"
    assert "System role not supported" in refused.value.reason and "row 0" in refused.value.reason
    assert "the model's chat template" in refused.value.reason
    # the same template given as a file, with a toy task: named after the file
    strict = tmp_path / "strict.jinja"
    strict.write_text("{{ raise_exception('no ' + messages[0]['role'] + ' turns here') }}")
    with pytest.raises(ConfigError) as refused:
        make_task(TaskConfig(chat_template=str(strict)), str(MODEL))
    assert refused.value.field == "task.chat_template"
    assert "no user turns here" in refused.value.reason and str(strict) in refused.value.reason
    # one that does not parse: jinja2's message and line, no traceback's worth of text
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ConfigError) as refused:
        make_task(TaskConfig(entrypoint=DIALOGUE, chat_template=str(broken)), str(MODEL))
    assert refused.value.field == "task.chat_template"
    assert "does not parse" in refused.value.reason and "line 2" in refused.value.reason


def test_a_template_file_that_is_missing_or_empty_is_refused(tmp_path):
    (tmp_path / "empty.jinja").write_text("\n")
    for path, words in ((tmp_path / "absent.jinja", "cannot read"), (tmp_path / "empty.jinja", "is empty")):
        with pytest.raises(ConfigError) as refused:
            make_task(TaskConfig(entrypoint=DIALOGUE, chat_template=str(path)), str(MODEL))
        assert refused.value.field == "task.chat_template" and words in refused.value.reason
    with pytest.raises(ConfigError) as refused:
        TaskConfig(chat_template=" ").validate()
    assert refused.value.field == "task.chat_template"


# -- 3. the probe sends the roles the task sends ------------------------------------------------
def test_a_template_without_system_or_tool_roles_serves_an_environment_that_sends_neither(styled):
    task = make_task(TaskConfig(entrypoint=DIALOGUE), str(styled["gemma"]))
    assert task.episodic and task.renderer.local_deltas
    # the calculator sends a system message and tool answers: refused, in the template's words
    with pytest.raises(ConfigError) as refused:
        make_task(TaskConfig(entrypoint=CALCULATOR), str(styled["gemma"]))
    assert refused.value.field == "task.chat_template"
    assert "Conversation roles must alternate" in refused.value.reason or \
        "System role not supported" in refused.value.reason


def test_an_environment_with_tools_is_probed_with_a_tool_message(styled):
    """A template that renders tool messages by rewriting the turn before them is refused for
    the calculator (it sends them), and accepted for the dialogue (it never does)."""
    rewriting = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last and "
                 "messages[loop.index0 + 1]['role'] == 'tool' %}{{ '<|im_start|>assistant\n[call]<|im_end|>\n' }}"
                 "{% else %}" + _TURN + "{% endif %}{% endfor %}" + _GENERATION)
    tokenizer = load(styled["qwen2.5"])
    tokenizer.chat_template = rewriting
    with pytest.raises(ConfigError, match="not prefix-preserving"):
        make_task(TaskConfig(entrypoint=CALCULATOR), str(styled["qwen2.5"]), tokenizer=tokenizer)
    assert make_task(TaskConfig(entrypoint=DIALOGUE), str(styled["qwen2.5"]), tokenizer=tokenizer).episodic


# -- 4. a template path: the prefix-preserving variant of a thinking template ----------------------
async def test_a_thinking_template_is_refused_saying_what_to_do_and_its_variant_runs_three_turns(tmp_path):
    model = tokenizer_dir(tmp_path / "thinking", THINKING, ["<|im_end|>", "<|endoftext|>"])
    with pytest.raises(ConfigError) as refused:
        make_task(TaskConfig(entrypoint=DIALOGUE, args={"turns": 3}), str(model))
    reason = refused.value.reason
    assert refused.value.field == "task.chat_template" and "not prefix-preserving" in reason
    assert "path" in reason and "prefix-preserving variant" in reason and "chat_template = false" not in reason

    variant = tmp_path / "thinking-kept.jinja"
    variant.write_text(THINKING_KEPT)
    task = make_task(TaskConfig(entrypoint=DIALOGUE, args={"turns": 3}, chat_template=str(variant)), str(model))
    r = task.renderer
    assert r.tokenizer.chat_template == THINKING_KEPT and load(model).chat_template == THINKING
    end = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = [f"<think>\nturn {n}\n</think>\n{n}" for n in (1, 2, 3)]
    replies = Replies(r, texts, [end, end, end])
    episode = await run_episode(task.runner.env, r, replies, {"index": 0}, max_tokens_per_turn=32)
    assert episode.turns == 3
    for before, after in zip(replies.prompts, replies.prompts[1:]):
        assert after[:len(before)] == before
    third = r.tokenizer.decode(replies.prompts[-1])
    assert third == r.render(episode.messages[:5], add_generation_prompt=True)
    assert "turn 1" in third and "turn 2" in third, "past reasoning stays in the context, as it was sampled"
    dropped = TurnRenderer(load(model)).render(episode.messages[:5], add_generation_prompt=True)
    assert "turn 1" not in dropped, "the model's own template would have rewritten turn 1"
