"""Chat templates and stop tokens (#30 item 4): which template renders a task's prompts, what a
template's own error becomes, and which token ids end an engine's turn.

    task.chat_template = true            the model's template (its tokenizer's)
    task.chat_template = false           no template: prompt text tokenized as it is
    task.chat_template = "my.jinja"      the template in that file (e.g. a prefix-preserving
                                         variant of a thinking template), for every prompt and turn

A template that raises (`raise_exception("System role not supported")`, a strict user/assistant
alternation, a syntax error) is a `TemplateError` naming `task.chat_template` with the template's
own message: `inflight run` exits 2 with one line, never a jinja2 traceback.

The stop ids are every id the engine stops a turn on: the tokenizer's eos, the model's
generation_config.json `eos_token_id` (an int or a list: vLLM adds them to every request) and
the run's `sampling.stop_token_ids`. A multi-turn renderer that knows only one of them would
follow a turn that ended on another with the template's whole end of turn: two in a row.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from orchestrator.errors import ConfigError


class TemplateError(ConfigError):
    """The chat template cannot render what a task sends, or cannot extend an episode by
    appending tokens."""


class TemplateRaised(TemplateError):
    """The template itself raised (its `raise_exception`, a syntax error, a type error)."""


def template_source(chat_template: bool | str) -> str:
    """The template's name in an error message."""
    if isinstance(chat_template, str):
        return f"the chat template in {chat_template}"
    return "the model's chat template"


def template_text(chat_template: bool | str, field: str) -> str | None:
    """The text of a template file (`task.chat_template` as a path); None for the model's own.
    An unreadable or empty file is refused, naming `field`."""
    if not isinstance(chat_template, str):
        return None
    path = Path(chat_template)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, f"cannot read the chat template file {path}: {exc}") from None
    if not text.strip():
        raise ConfigError(field, f"{path} is empty: a Jinja chat template expected")
    return text


def with_template(tokenizer, chat_template: bool | str, field: str):
    """The tokenizer whose template renders the task: itself, or (a path) a copy of it holding
    that file's template (a copy: a tokenizer handed in by the caller is left as it was). An
    unreadable or empty file is refused, naming `field`; one that does not parse is refused
    by the first rendering at start (`template_errors`)."""
    text = template_text(chat_template, field)
    if text is None:
        return tokenizer
    copied = copy.copy(tokenizer)
    copied.chat_template = text
    return copied


@contextlib.contextmanager
def template_errors(field: str, source: str, rendering: Sequence[dict] | None = None) -> Iterator[None]:
    """Turn an error the template raises while rendering into a TemplateError naming `field`,
    with the template's own message and the roles it was asked to render. TypeError is the
    template's too (`'text' + none` in its code): apply_chat_template is called with fixed
    arguments, so nothing else raises it there."""
    import jinja2

    try:
        yield
    except (jinja2.TemplateError, TypeError) as exc:
        if isinstance(exc, jinja2.TemplateSyntaxError):
            raise TemplateRaised(field, f"{source} does not parse: {exc.message} (line {exc.lineno})") from None
        roles = f" rendering roles {[m.get('role') for m in rendering]}" if rendering is not None else ""
        message = exc.message if isinstance(exc, jinja2.TemplateError) and exc.message else str(exc)
        if isinstance(exc, TypeError):
            message = f"TypeError: {message}"
        raise TemplateRaised(field, f"{source} raised{roles}: {message}") from None


def engine_stop_ids(tokenizer, model_dir: str | Path | None, sampling=None) -> frozenset[int]:
    """Every token id an engine ends a turn on: the tokenizer's eos, the model's
    generation_config.json `eos_token_id` (int or list), and `sampling.stop_token_ids` (a
    `replay.records.SamplingSettings`); with `sampling.ignore_eos` only the last (vLLM then
    ignores every eos)."""
    ids: set[int] = set(int(t) for t in getattr(sampling, "stop_token_ids", ()) or ())
    if getattr(sampling, "ignore_eos", False):
        return frozenset(ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        ids.update(generation_eos_ids(Path(model_dir)))
    return frozenset(ids)


def generation_eos_ids(model_dir: Path) -> list[int]:
    """generation_config.json's `eos_token_id`, an int or a list ([] when absent or unreadable:
    the engine then reads none either)."""
    path = model_dir / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
