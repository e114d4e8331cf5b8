"""Reward components from config: built-ins, the user's functions (TRL-style), errors at start."""

from __future__ import annotations

import asyncio
import itertools
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from orchestrator.errors import ConfigError
from orchestrator.tasks.rewards import RewardError, RewardSet, build_rewards, normalize_answer

pytestmark = pytest.mark.timeout(120)

_module_ids = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module into tmp_path (not importable until build_rewards gets search_path)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # build_rewards prepends; undone after the test
    written: list[str] = []

    def write(source: str) -> str:
        name = f"user_rewards_{next(_module_ids)}_{tmp_path.name.replace('-', '_')}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def _build(specs, tmp_path, **kw) -> RewardSet:
    return build_rewards(specs, search_path=[tmp_path], **kw)


# --- built-ins ------------------------------------------------------------------------------------

def test_exact_normalises_then_compares_the_whole_completion():
    rewards = build_rewards([{"fn": "exact"}])
    row = {"prompt": "capital of France?", "answer": "Paris"}
    assert rewards.score("  PARIS. ", [], row) == {"reward": 1.0, "exact": 1.0}
    assert rewards.score("paris", [], {"answer": "Paris."})["exact"] == 1.0
    assert rewards.score("Ｐａｒｉｓ", [], row)["exact"] == 1.0  # NFKC: full-width letters
    assert rewards.score("new\t york", [], {"answer": "New York"})["exact"] == 1.0
    assert rewards.score("Paris is the capital", [], row)["exact"] == 0.0
    assert rewards.score("Lyon", [], row) == {"reward": 0.0, "exact": 0.0}
    assert rewards.score("42", [], {"answer": 42})["exact"] == 1.0  # a JSON number column
    assert normalize_answer(" A  b. ") == "a b" and normalize_answer("3.5") == "3.5"


def test_exact_field_option_reads_another_column():
    rewards = build_rewards([{"fn": "exact", "field": "label"}], answer_field="answer")
    assert rewards.components[0].columns == frozenset({"label"})
    assert rewards.score("yes", [], {"answer": "no", "label": "yes"})["exact"] == 1.0
    default = build_rewards([{"fn": "exact"}], answer_field="solution")
    assert default.score("yes", [], {"solution": "yes"})["exact"] == 1.0


def test_math_verifies_boxed_fractions_and_latex_and_rejects_wrong_answers():
    rewards = build_rewards([{"fn": "math"}])
    half = {"answer": "0.5"}
    assert rewards.score("so the answer is \\boxed{1/2}", [], half)["math"] == 1.0
    assert rewards.score("$\\frac{1}{2}$", [], half)["math"] == 1.0
    assert rewards.score("\\boxed{0.5}", [], {"answer": "\\frac{1}{2}"})["math"] == 1.0
    assert rewards.score("1/2", [], {"answer": "\\frac{1}{2}"})["math"] == 1.0
    assert rewards.score("\\boxed{\\sqrt{2}}", [], {"answer": "\\sqrt{2}"})["math"] == 1.0
    assert rewards.score("\\boxed{1/3}", [], half)["math"] == 0.0
    assert rewards.score("I do not know", [], half)["math"] == 0.0
    # The gold is read whole as LaTeX: "3\pi" is not the number 3.
    assert rewards.score("\\boxed{3}", [], {"answer": "3\\pi"})["math"] == 0.0
    assert rewards.score("\\boxed{3\\pi}", [], {"answer": "3\\pi"})["math"] == 1.0


def test_math_runs_in_worker_threads_where_signal_timeouts_cannot():
    # math-verify's default timeouts use SIGALRM, which raises off the main thread.
    rewards = build_rewards([{"fn": "math"}])
    cases = [(f"\\boxed{{{n}/{2 * n}}}", "0.5", 1.0) for n in range(1, 9)] + \
            [(f"\\boxed{{{n}/3}}", "0.5", 0.0) for n in range(1, 9)]

    def one(case):
        completion, gold, want = case
        return rewards.score(completion, [], {"answer": gold})["math"] == want

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, cases))


def test_math_with_an_unparseable_gold_errors_instead_of_scoring_zero():
    rewards = build_rewards([{"fn": "math", "name": "acc"}])
    with pytest.raises(RewardError) as info:
        rewards.score("\\boxed{1}", [], {"answer": ""})
    assert info.value.component == "acc" and "cannot parse the answer" in str(info.value)


def test_regex_search_and_fullmatch():
    search = build_rewards([{"fn": "regex", "pattern": r"<answer>.*</answer>"}])
    assert search.score("think... <answer>4</answer>", [], {}) == {"reward": 1.0, "regex": 1.0}
    assert search.score("4", [], {})["regex"] == 0.0
    full = build_rewards([{"fn": "regex", "pattern": r"\d+", "mode": "fullmatch"}])
    assert full.score("123", [], {})["regex"] == 1.0
    assert full.score("123 apples", [], {})["regex"] == 0.0
    assert full.components[0].columns == frozenset()


def test_a_missing_answer_column_errors_naming_the_column_and_component():
    rewards = build_rewards([{"fn": "exact", "name": "exact_label", "field": "label"}])
    with pytest.raises(RewardError) as info:
        rewards.score("x", [], {"prompt": "p", "answer": "x"})
    err = info.value
    assert err.component == "exact_label" and "'label'" in err.message and "prompt, answer" in err.message
    with pytest.raises(RewardError, match="null"):
        build_rewards([{"fn": "math"}]).score("1", [], {"answer": None})


def test_weights_are_summed_and_every_component_reported(tmp_path, user_module):
    mod = user_module("""
        def length_penalty(completion):
            return len(completion) / 10
    """)
    rewards = _build([{"fn": "exact", "weight": 2.0}, {"fn": "regex", "pattern": "^4", "weight": 0.25},
                      {"fn": f"{mod}:length_penalty", "weight": -0.5}], tmp_path)
    scores = rewards.score("4", [7], {"answer": "4"})
    assert scores == {"reward": 2.0 * 1.0 + 0.25 * 1.0 - 0.5 * 0.1, "exact": 1.0, "regex": 1.0,
                      "length_penalty": 0.1}
    assert list(scores) == ["reward", "exact", "regex", "length_penalty"]
    assert [c.weight for c in rewards.components] == [2.0, 0.25, -0.5]
    assert rewards.names == ["exact", "regex", "length_penalty"]


# --- the user's functions -------------------------------------------------------------------------

def test_a_function_taking_only_answer_gets_only_answer(tmp_path, user_module):
    mod = user_module("""
        seen = []
        def right_answer(answer, completion):
            seen.append((answer, completion))
            return completion.strip() == str(answer)
    """)
    rewards = _build([{"fn": f"{mod}:right_answer"}], tmp_path)
    component = rewards.components[0]
    assert component.name == "right_answer" and not component.is_async
    assert component.columns == frozenset({"answer"})
    row = {"prompt": "2+2?", "answer": 4, "difficulty": "easy"}
    assert rewards.score(" 4", [1, 2], row) == {"reward": 1.0, "right_answer": 1.0}  # True -> 1.0
    assert rewards.score("5", [1], row)["right_answer"] == 0.0
    assert sys.modules[mod].seen == [(4, " 4"), (4, "5")]


def test_a_function_with_kwargs_gets_every_column_and_the_bound_options(tmp_path, user_module):
    mod = user_module("""
        calls = []
        def everything(completion, completion_ids, scale, **kw):
            calls.append(dict(completion=completion, completion_ids=completion_ids, scale=scale, **kw))
            return scale * len(completion_ids)
    """)
    rewards = _build([{"fn": f"{mod}:everything", "name": "ids", "scale": 0.5, "bonus": 3}], tmp_path)
    assert rewards.score("abc", [5, 6, 7, 8], {"prompt": "p", "answer": "a", "scale": 99}) == \
        {"reward": 2.0, "ids": 2.0}
    # The spec's options win over a row column of the same name; completion and ids win over both.
    assert sys.modules[mod].calls == [{"completion": "abc", "completion_ids": [5, 6, 7, 8], "scale": 0.5,
                                       "prompt": "p", "answer": "a", "bonus": 3}]


def test_a_required_column_the_row_lacks_is_a_reward_error(tmp_path, user_module):
    mod = user_module("""
        def needs_label(completion, label):
            return 1.0
    """)
    rewards = _build([{"fn": f"{mod}:needs_label"}], tmp_path)
    with pytest.raises(RewardError, match="needs_label.*TypeError.*label"):
        rewards.score("x", [], {"answer": "a"})


def test_async_functions_run_on_one_loop_per_thread_in_two_threads_at_once(tmp_path, user_module):
    mod = user_module("""
        import asyncio, threading
        both_inside = threading.Barrier(2, timeout=20)
        loops = {}
        async def slow_check(completion, answer):
            await asyncio.sleep(0.001)
            loops.setdefault(threading.get_ident(), []).append(asyncio.get_running_loop())
            both_inside.wait()  # passes only while the other thread is inside a call too
            await asyncio.sleep(0)
            return float(completion == answer)
    """)
    rewards = _build([{"fn": f"{mod}:slow_check"}], tmp_path)
    assert rewards.components[0].is_async

    def three_calls(answer: str) -> list[float]:
        return [rewards.score(answer, [], {"answer": answer})["slow_check"] for _ in range(3)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(three_calls, ["a", "b"]))
    assert results == [[1.0] * 3, [1.0] * 3]
    loops = sys.modules[mod].loops
    assert len(loops) == 2
    per_thread = [ls for ls in loops.values()]
    assert all(len(ls) == 3 and all(loop is ls[0] for loop in ls) for ls in per_thread)  # reused
    assert per_thread[0][0] is not per_thread[1][0]


def test_async_components_refuse_to_run_on_an_event_loop(tmp_path, user_module):
    mod = user_module("""
        async def later(completion):
            return 1.0
    """)
    rewards = _build([{"fn": f"{mod}:later"}], tmp_path)

    async def on_the_loop():
        return rewards.score("x", [], {})

    with pytest.raises(RuntimeError, match="worker thread"):
        asyncio.run(on_the_loop())
    assert rewards.score("x", [], {}) == {"reward": 1.0, "later": 1.0}


def test_a_raising_function_is_a_one_line_reward_error(tmp_path, user_module):
    mod = user_module("""
        def divide(completion):
            return 1 / 0
        def loud(completion):
            raise ValueError("first line\\nsecond line")
    """)
    rewards = _build([{"fn": f"{mod}:divide", "name": "ratio"}], tmp_path)
    with pytest.raises(RewardError) as info:
        rewards.score("x", [], {})
    assert info.value.component == "ratio"
    assert str(info.value) == "reward 'ratio': ZeroDivisionError: division by zero"
    with pytest.raises(RewardError) as info:
        _build([{"fn": f"{mod}:loud"}], tmp_path).score("x", [], {})
    assert "\n" not in str(info.value) and "ValueError: first line second line" in str(info.value)


@pytest.mark.parametrize("returned, why", [("float('nan')", "nan"), ("float('-inf')", "-inf"),
                                           ("None", "NoneType"), ("'1.0'", "str"), ("[1.0]", "list"),
                                           ("10 ** 400", "too large")])
def test_a_non_finite_or_non_number_return_is_a_reward_error(tmp_path, user_module, returned, why):
    mod = user_module(f"""
        def bad(completion):
            return {returned}
    """)
    with pytest.raises(RewardError) as info:
        _build([{"fn": f"{mod}:bad"}], tmp_path).score("x", [], {})
    assert info.value.component == "bad" and why in info.value.message and "finite number" in info.value.message


def test_ints_bools_and_numpy_scalars_are_numbers(tmp_path, user_module):
    mod = user_module("""
        import numpy as np
        def as_int(completion): return 2
        def as_bool(completion): return False
        def as_numpy(completion): return np.float32(0.25)
    """)
    rewards = _build([{"fn": f"{mod}:as_int"}, {"fn": f"{mod}:as_bool"}, {"fn": f"{mod}:as_numpy"}], tmp_path)
    scores = rewards.score("x", [], {})
    assert scores == {"reward": 2.25, "as_int": 2.0, "as_bool": 0.0, "as_numpy": 0.25}
    assert all(type(v) is float for v in scores.values())


# --- errors at start ------------------------------------------------------------------------------

def _config_error(specs, tmp_path=None, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build_rewards(specs, search_path=[tmp_path] if tmp_path else None, **kw)
    assert "\n" not in str(info.value)
    return info.value


def test_an_unimportable_function_names_the_field_module_and_import_error(tmp_path, user_module):
    err = _config_error([{"fn": "exact"}, {"fn": "no_such_pkg_xyz.rewards:f"}], tmp_path)
    assert err.field == "task.rewards[1].fn"
    assert "'no_such_pkg_xyz.rewards'" in err.reason and "ModuleNotFoundError" in err.reason
    broken = user_module("def f(:\n")
    err = _config_error([{"fn": f"{broken}:f"}], tmp_path)
    assert err.field == "task.rewards[0].fn" and "SyntaxError" in err.reason
    mod = user_module("VALUE = 3\ndef real(completion): return 1.0\n")
    err = _config_error([{"fn": f"{mod}:missing"}], tmp_path)
    assert err.field == "task.rewards[0].fn" and "has no attribute 'missing'" in err.reason
    err = _config_error([{"fn": f"{mod}:VALUE"}], tmp_path)
    assert "not callable" in err.reason and "int" in err.reason
    err = _config_error([{"fn": "exakt"}])
    assert err.field == "task.rewards[0].fn" and "unknown reward 'exakt'" in err.reason
    err = _config_error([{"fn": f"{mod}:"}], tmp_path)
    assert err.field == "task.rewards[0].fn"


def test_search_path_makes_a_package_in_the_working_directory_importable(tmp_path, user_module):
    pkg = tmp_path / "my_task_pkg_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def correct(completion, answer, **kw):\n    return completion == answer\n")
    try:
        _config_error([{"fn": "my_task_pkg_rewards.scoring:correct"}])  # not on sys.path yet
        rewards = build_rewards([{"fn": "my_task_pkg_rewards.scoring:correct"}], search_path=[tmp_path])
        assert rewards.score("7", [], {"answer": "7"}) == {"reward": 1.0, "correct": 1.0}
    finally:
        for name in ("my_task_pkg_rewards", "my_task_pkg_rewards.scoring"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("weight", ["1", float("nan"), float("inf"), True, None])
def test_a_weight_that_is_not_a_finite_number_is_refused(weight):
    err = _config_error([{"fn": "exact", "weight": weight}])
    assert err.field == "task.rewards[0].weight" and "finite number" in err.reason


def test_regex_pattern_and_mode_are_checked(tmp_path):
    err = _config_error([{"fn": "exact"}, {"fn": "math"}, {"fn": "regex"}])
    assert err.field == "task.rewards[2].pattern" and "required" in err.reason
    err = _config_error([{"fn": "regex", "pattern": "(unclosed"}])
    assert err.field == "task.rewards[0].pattern" and "missing ), unterminated subpattern" in err.reason
    err = _config_error([{"fn": "regex", "pattern": "a", "mode": "match"}])
    assert err.field == "task.rewards[0].mode"


def test_an_option_a_builtin_does_not_take_is_named(tmp_path, user_module):
    err = _config_error([{"fn": "exact", "pattern": "x"}])
    assert err.field == "task.rewards[0].pattern" and "takes: field" in err.reason
    err = _config_error([{"fn": "regex", "pattern": "x", "field": "answer"}])
    assert err.field == "task.rewards[0].field"
    mod = user_module("def strict(completion, answer): return 1.0\n")
    err = _config_error([{"fn": f"{mod}:strict", "scale": 2}], tmp_path)
    assert err.field == "task.rewards[0].scale" and "strict() takes no parameter 'scale'" in err.reason
    err = _config_error([{"fn": f"{mod}:strict", "completion": "fixed"}], tmp_path)
    assert err.field == "task.rewards[0].completion"


def test_component_names_are_unique_and_reward_is_reserved(tmp_path, user_module):
    err = _config_error([{"fn": "exact"}, {"fn": "regex", "pattern": "x"}, {"fn": "exact", "field": "b"}])
    assert err.field == "task.rewards[2].name" and "duplicate" in err.reason and "task.rewards[0]" in err.reason
    assert build_rewards([{"fn": "exact"}, {"fn": "exact", "field": "b", "name": "exact_b"}]).names == \
        ["exact", "exact_b"]
    err = _config_error([{"fn": "exact", "name": "reward"}])
    assert err.field == "task.rewards[0].name" and "reserved" in err.reason
    mod = user_module("def reward(completion): return 1.0\n")
    assert _config_error([{"fn": f"{mod}:reward"}], tmp_path).field == "task.rewards[0].name"
    assert _build([{"fn": f"{mod}:reward", "name": "mine"}], tmp_path).names == ["mine"]
    assert _config_error([{"fn": "exact", "name": ""}]).field == "task.rewards[0].name"


def test_the_spec_list_itself_is_checked():
    assert _config_error([]).field == "task.rewards"
    assert _config_error(["exact"]).field == "task.rewards[0]"
    assert _config_error([{"weight": 1.0}]).field == "task.rewards[0].fn"
    assert _config_error([{"fn": "exact"}, {"fn": "nope"}], where="eval.rewards").field == "eval.rewards[1].fn"


def test_reward_error_is_one_line_naming_the_component():
    err = RewardError("acc", "bad\nthing   here")
    assert err.component == "acc" and err.message == "bad thing here"
    assert str(err) == "reward 'acc': bad thing here"
