"""Reward functions from config: `task.rewards = [{fn, weight, name, <options>}]`, summed by weight.

`fn` is a built-in ("exact", "math", "regex") or the user's "package.module:function". A user's
function is called TRL-style with keyword arguments, `fn(completion=TEXT, completion_ids=IDS, **row)`
(only the parameters it names unless it takes `**kwargs`), plus the spec's extra keys bound like
functools.partial; it may be sync or async. Everything is checked in `build_rewards`, at start,
and a bad spec raises ConfigError naming its exact field.

Scoring is synchronous: the caller runs `RewardSet.score` in a worker thread, never on the event
loop. An async component runs on an event loop owned by that thread and reused across calls
(`user_code.call_in_thread`). A user's function is imported by `entrypoint.load_callable`.
A component that raises, or returns anything but a finite number, raises RewardError: the rollout
errors with that message; no value is invented in its place.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import re
import unicodedata
from collections.abc import Callable, Sequence
from functools import lru_cache

from orchestrator.errors import ConfigError
from orchestrator.tasks.entrypoint import extend_sys_path, load_callable
from orchestrator.tasks.user_code import call_in_thread, refuse_running_loop
from orchestrator.tasks.user_code import is_async as user_is_async

RESERVED_NAME = "reward"  # the key of the weighted sum in RewardSet.score
BUILTINS = ("exact", "math", "regex")
_SPEC_KEYS = ("fn", "weight", "name")


class RewardError(Exception):
    """One reward component failed on one completion; str() is one line naming the component."""

    def __init__(self, component: str, message: str) -> None:
        self.component = component
        self.message = " ".join(str(message).split())  # one line, whatever the exception said
        super().__init__(f"reward {component!r}: {self.message}")


class _Failure(Exception):
    """A built-in's own failure (no answer column, ...): RewardFn reports it under its name."""


class RewardFn:
    """One named, weighted component: `(completion, completion_ids, row) -> float`, checked."""

    def __init__(self, name: str, weight: float, fn: Callable[..., object], *, is_async: bool,
                 columns: frozenset[str] = frozenset()) -> None:
        self.name = name
        self.weight = weight
        self.is_async = is_async
        # Row columns the component needs by name (the caller may check a dataset against them).
        self.columns = columns
        self._fn = fn  # called as fn(completion, completion_ids, row)

    def __call__(self, completion: str, completion_ids: list[int], row: dict) -> float:
        if self.is_async:
            refuse_running_loop("RewardSet.score")
        try:
            value = call_in_thread(self._fn, completion, completion_ids, row)
        except _Failure as exc:
            raise RewardError(self.name, str(exc)) from exc
        except Exception as exc:  # the user's code: any failure is this rollout's error
            raise RewardError(self.name, f"{type(exc).__name__}: {exc}") from exc
        return _checked_number(self.name, value)

    def __repr__(self) -> str:
        return f"RewardFn(name={self.name!r}, weight={self.weight!r}, is_async={self.is_async})"


class RewardSet:
    """The configured components; `score` gives the weighted sum and every component's value."""

    def __init__(self, components: list[RewardFn]) -> None:
        self.components = components

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    @property
    def columns(self) -> frozenset[str]:
        return frozenset().union(*(c.columns for c in self.components))

    def score(self, completion: str, completion_ids: list[int], row: dict) -> dict[str, float]:
        """{"reward": sum(weight * value), "<name>": value, ...}. Sync: call it in a worker thread."""
        values = {c.name: c(completion, completion_ids, row) for c in self.components}
        total = math.fsum(c.weight * values[c.name] for c in self.components)
        return {RESERVED_NAME: total, **values}


def build_rewards(specs: Sequence[dict], *, answer_field: str = "answer", where: str = "task.rewards",
                  search_path: Sequence[str | os.PathLike] | None = None) -> RewardSet:
    """Every component of `specs`, validated now; ConfigError names the first bad field."""
    if not specs:
        raise ConfigError(where, 'at least one reward is required, e.g. [{fn = "exact"}]')
    extend_sys_path(search_path or [])  # once for every component
    components: list[RewardFn] = []
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        field = f"{where}[{i}]"
        component = _build_one(spec, field, answer_field)
        if component.name in seen:
            raise ConfigError(f"{field}.name", f"duplicate component name {component.name!r} (also "
                                               f"{where}[{seen[component.name]}]); give each a distinct `name`")
        seen[component.name] = i
        components.append(component)
    return RewardSet(components)


# --- one spec -------------------------------------------------------------------------------------

def _build_one(spec: object, field: str, answer_field: str) -> RewardFn:
    if not isinstance(spec, dict):
        raise ConfigError(field, f"must be a table like {{fn = \"exact\", weight = 1.0}}, got {type(spec).__name__}")
    fn = spec.get("fn")
    if not isinstance(fn, str) or not fn.strip():
        raise ConfigError(f"{field}.fn", 'required: "exact", "math", "regex" or "package.module:function"')
    weight = _weight(spec.get("weight", 1.0), f"{field}.weight")
    options = {k: v for k, v in spec.items() if k not in _SPEC_KEYS}
    for key in options:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{field}.{key}", "an option's name must be a Python identifier")
    if fn in BUILTINS:
        call, columns = _builtin(fn, options, field, answer_field)
        default_name, is_async = fn, False
    elif ":" in fn:
        user = load_callable(fn, f"{field}.fn")
        call, columns = _bind_user_function(user, options, field)
        default_name, is_async = _callable_name(user), user_is_async(user)
    else:
        raise ConfigError(f"{field}.fn", f"unknown reward {fn!r}: a built-in ({', '.join(BUILTINS)}) "
                                          "or 'package.module:function'")
    name = _name(spec.get("name", default_name), f"{field}.name")
    return RewardFn(name, weight, call, is_async=is_async, columns=columns)


def _weight(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    return float(value)


def _name(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(field, f"must be a non-empty string, got {value!r}")
    if value == RESERVED_NAME:
        raise ConfigError(field, f"{RESERVED_NAME!r} is reserved for the weighted sum; set another `name`")
    return value


def _checked_number(component: str, value: object) -> float:
    # bool is an int: a pass/fail function may return True/False. numpy scalars are numbers.Real.
    if not isinstance(value, numbers.Real):
        raise RewardError(component, f"returned {type(value).__name__} {value!r:.80}; a reward must be a finite number")
    try:
        result = float(value)
    except (OverflowError, ValueError) as exc:  # an int past float's range
        raise RewardError(component, f"returned {value!r:.80}: {exc}; a reward must be a finite number") from exc
    if not math.isfinite(result):
        raise RewardError(component, f"returned {result}; a reward must be a finite number")
    return result


# --- built-ins ------------------------------------------------------------------------------------

def _builtin(fn: str, options: dict, field: str, answer_field: str) -> tuple[Callable, frozenset[str]]:
    accepted = {"exact": ("field",), "math": ("field",), "regex": ("pattern", "mode")}[fn]
    for key in options:
        if key not in accepted:
            takes = ", ".join(accepted)
            raise ConfigError(f"{field}.{key}", f"the {fn!r} reward takes no option {key!r} (it takes: {takes})")
    if fn == "regex":
        return _regex_reward(options, field), frozenset()
    column = options.get("field", answer_field)
    if not isinstance(column, str) or not column:
        raise ConfigError(f"{field}.field", f"must be a column name, got {column!r}")
    if fn == "math":
        _math_verify_at_start(f"{field}.fn")
    score = _exact_match if fn == "exact" else _math_equal
    return (lambda completion, ids, row: score(completion, _gold(row, column))), frozenset({column})


def _gold(row: dict, column: str) -> str:
    if column not in row:
        raise _Failure(f"the row has no answer column {column!r} (columns: {', '.join(map(str, row))})")
    value = row[column]
    if value is None:
        raise _Failure(f"the answer column {column!r} is empty (null) in this row")
    return value if isinstance(value, str) else str(value)


def normalize_answer(text: str) -> str:
    """strip, Unicode NFKC, casefold, collapse whitespace, strip one trailing period."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def _exact_match(completion: str, gold: str) -> float:
    return 1.0 if normalize_answer(completion) == normalize_answer(gold) else 0.0


def _regex_reward(options: dict, field: str) -> Callable:
    pattern = options.get("pattern")
    if not isinstance(pattern, str):
        raise ConfigError(f"{field}.pattern", f"required: a regular expression (a string), got {pattern!r}")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"{field}.pattern", f"bad regular expression {pattern!r}: {exc}") from exc
    mode = options.get("mode", "search")
    if mode not in ("search", "fullmatch"):
        raise ConfigError(f"{field}.mode", f'must be "search" or "fullmatch", got {mode!r}')
    match = compiled.search if mode == "search" else compiled.fullmatch
    return lambda completion, ids, row: 1.0 if match(completion) else 0.0


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once that its signal-based timeout is off; here that is by design (the
    # caller bounds each scoring call with task.score_timeout_s), so the warning would mislead.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _math_verify():
    import math_verify

    for module in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(module).addFilter(_DropTimeoutDisabledWarning())
    return math_verify


def _math_verify_at_start(field: str) -> None:
    # Imported now, not in the first scoring call (where it would count against its timeout).
    try:
        _math_verify()
    except ImportError as exc:
        raise ConfigError(field, f"the 'math' reward needs math-verify: {exc}") from exc


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    # A bare answer column ("3\\pi", "(1, 2)") parsed as free text keeps only a number out of it;
    # as LaTeX math it is read whole. One already delimited ($...$, \boxed{}) is parsed as it is.
    mv = _math_verify()
    text = gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"
    return tuple(mv.parse(text, parsing_timeout=None))


def _math_equal(completion: str, gold: str) -> float:
    """math-verify equivalence of the completion (boxed, LaTeX, plain) with the gold answer.

    Its timeouts use SIGALRM, which works only in the main thread: they are off here (None), so
    this runs in any worker thread; the caller bounds the whole scoring call instead.
    """
    mv = _math_verify()
    parsed_gold = _parse_gold(gold)
    if not parsed_gold:
        raise _Failure(f"math-verify cannot parse the answer {gold!r:.80}")
    prediction = mv.parse(completion, parsing_timeout=None)
    return 1.0 if mv.verify(list(parsed_gold), prediction, timeout_seconds=None) else 0.0


# --- the user's function --------------------------------------------------------------------------

def _callable_name(fn: Callable) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", None) or type(inner).__name__


def _bind_user_function(fn: Callable, options: dict, field: str) -> tuple[Callable, frozenset[str]]:
    """fn(completion=, completion_ids=, **row, **options), keeping only what fn names (no **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (some builtins): pass everything
        params = None
    takes_all = params is None or any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = set() if params is None else {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                      p.KEYWORD_ONLY)}
    fn_name = _callable_name(fn)
    for name, p in (params or {}).items():
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise ConfigError(f"{field}.fn", f"{fn_name}() has a positional-only parameter {name!r}; "
                                             "a reward function takes keyword arguments")
    for key in options:
        if key in ("completion", "completion_ids"):
            raise ConfigError(f"{field}.{key}", f"{key!r} is what is scored, passed at each call; not an option")
        if not takes_all and key not in named:
            raise ConfigError(f"{field}.{key}", f"{fn_name}() takes no parameter {key!r} (and no **kwargs)")
    given = {"completion", "completion_ids", *options}
    columns = frozenset(n for n, p in (params or {}).items()
                        if n in named and p.default is p.empty and n not in given)

    def call(completion: str, completion_ids: list[int], row: dict) -> object:
        kwargs = {**row, **options, "completion": completion, "completion_ids": completion_ids}
        if not takes_all:
            kwargs = {k: v for k, v in kwargs.items() if k in named}
        return fn(**kwargs)

    return call, columns
