"""The reasoning-gym adapter: the library's rows, its own answer extraction and scorer, named errors."""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest

from orchestrator.errors import ConfigError
from orchestrator.tasks.reasoning_gym import ReasoningGymTask, make

pytestmark = [pytest.mark.timeout(120), pytest.mark.light_lane]

SIZE = 25


def _tagged(answer: str) -> str:
    # What the library's extractor accepts: the last <answer>...</answer> of the completion.
    return f"<think>working it out</think>\n<answer>{answer}</answer>"


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "countdown"])
def test_the_libraries_gold_answers_score_one(dataset):
    task = make(dataset, size=SIZE, seed=3)
    assert task.name == f"reasoning_gym.{dataset}" and len(task) == SIZE
    for i in range(SIZE):
        row = task.row(i)
        assert row["answer"] == task.entry(i)["answer"] and row["index"] == i
        assert task.score(_tagged(row["answer"]), [1, 2], row) == 1.0


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum"])
def test_wrong_or_untagged_arithmetic_answers_score_zero(dataset):
    task = make(dataset, size=SIZE, seed=3)
    for i in range(SIZE):
        row = task.row(i)
        off_by_one = str(Decimal(row["answer"]) + 1)
        assert task.score(_tagged(off_by_one), [], row) == 0.0
        assert task.score(row["answer"], [], row) == 0.0  # right number, but not in the tags
        # Only the last tagged answer counts.
        assert task.score(_tagged(row["answer"]) + _tagged(off_by_one), [], row) == 0.0


def test_wrong_countdown_answers_score_the_librarys_partial_credit_not_one():
    # countdown's own scorer never gives 0: 0.05 for a well-formed expression over the given
    # numbers that misses the target, 0.01 for no answer or one it cannot parse.
    task = make("countdown", size=SIZE, seed=3)
    for i in range(SIZE):
        row, entry = task.row(i), task.entry(i)
        numbers, target = entry["metadata"]["numbers"], entry["metadata"]["target"]
        wrong = " + ".join(map(str, numbers)) if sum(numbers) != target else " * ".join(map(str, numbers))
        assert task.score(_tagged(wrong), [], row) == 0.05
        assert task.score(_tagged("1 + 1"), [], row) == 0.05  # not the given numbers
        assert task.score("no tags at all", [], row) == 0.01
        assert task.score(_tagged("not an expression ("), [], row) == 0.01


def test_rows_are_deterministic_in_seed_and_index_and_carry_the_librarys_instruction():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    task, again, other = make("chain_sum", size=SIZE, seed=5), make("chain_sum", size=SIZE, seed=5), \
        make("chain_sum", size=SIZE, seed=6)
    rows = [task.row(i) for i in range(SIZE)]
    assert rows == [again.row(i) for i in reversed(range(SIZE))][::-1]  # any order, same rows
    assert rows != [other.row(i) for i in range(SIZE)]
    assert set(rows[0]) == {"prompt", "answer", "index"}
    question = task.entry(0)["question"]
    assert rows[0]["prompt"] == f"{SYSTEM_PROMPTS['default'].strip()}\n\n{question}"
    assert "<answer>" in rows[0]["prompt"]
    direct = make("chain_sum", size=SIZE, seed=5, instruction="direct").row(0)["prompt"]
    assert direct.startswith("Answer the question directly") and direct.endswith(question)
    assert make("chain_sum", size=SIZE, seed=5, instruction="none").row(0)["prompt"] == question


def test_generator_options_reach_the_library():
    task = make("chain_sum", size=SIZE, seed=0, min_terms=4, max_terms=4, min_digits=1, max_digits=1)
    for i in range(SIZE):
        assert task.entry(i)["metadata"]["num_terms"] == 4
        assert task.score(_tagged(task.row(i)["answer"]), [], task.row(i)) == 1.0


def test_rows_outside_the_epoch_are_refused():
    task = make("basic_arithmetic", size=3)
    assert task.row(2)["index"] == 2
    for index in (3, -1):
        with pytest.raises(IndexError, match=r"\[0, 3\)"):
            task.row(index)
    with pytest.raises(ValueError, match="no 'index'"):
        task.score(_tagged("1"), [], {"answer": "1"})


def test_scoring_from_worker_threads_matches_scoring_in_order():
    task = make("countdown", size=SIZE, seed=9)
    cases = [(task.row(i), _tagged(task.row(i)["answer"] if i % 2 else "1 + 1")) for i in range(SIZE)]
    in_order = [task.score(completion, [], row) for row, completion in cases]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda case: task.score(case[1], [], case[0]), cases))
    assert threaded == in_order and set(in_order) == {1.0, 0.05}


def test_the_entrypoint_string_resolves_to_the_factory():
    module, _, attr = "orchestrator.tasks.reasoning_gym:make".partition(":")
    factory = getattr(importlib.import_module(module), attr)
    task = factory(**{"dataset": "basic_arithmetic", "size": 4, "seed": 1})
    assert isinstance(task, ReasoningGymTask) and len(task) == 4


def _error(**args) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make(**args)
    assert "\n" not in str(info.value)
    return info.value


def test_bad_arguments_name_the_field():
    err = _error(dataset="basic_arithmetc")
    assert err.field == "task.args.dataset" and "basic_arithmetic" in err.reason and "in all" in err.reason
    err = _error(dataset="no_such_thing_at_all")
    assert err.field == "task.args.dataset" and "countdown" in err.reason  # a few valid names anyway
    assert _error().field == "task.args.dataset"
    for size in (0, -2, "5", 2.5, True):
        assert _error(dataset="chain_sum", size=size).field == "task.args.size"
    assert _error(dataset="chain_sum", seed="x").field == "task.args.seed"
    err = _error(dataset="chain_sum", max_term=3)
    assert err.field == "task.args.max_term" and "max_terms" in err.reason
    err = _error(dataset="chain_sum", min_terms=5, max_terms=2)
    assert err.field == "task.args" and "min_terms" in err.reason
    err = _error(dataset="chain_sum", instruction="verbose")
    assert err.field == "task.args.instruction" and "default" in err.reason and "none" in err.reason
