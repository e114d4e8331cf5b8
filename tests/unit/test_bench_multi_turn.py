"""`inflight bench orchestrator`'s multi_turn_overhead_ratio: episodes through the environment
protocol on the real RunLoop and the zero-latency fake engine, against the same turns as
single-turn rollouts. Figures, not asserted times: the keys exist and each measurement consumed
what it was asked to."""

from __future__ import annotations

import pytest

from orchestrator.bench.multi_turn import TURNS, multi_turn_overhead
from orchestrator.bench.orchestrator import BenchRun, orchestrator_rate

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

# The tiny-rl tokenizer, built for the session (`rl_model`, tests/conftest.py): never the
# checkout's models/tiny-rl, which only `make run` builds (a fresh clone's suite has none).


async def test_the_multi_turn_row_measures_episodes_on_and_off_the_loop(rl_model):
    result = await multi_turn_overhead(BenchRun, orchestrator_rate, str(rl_model), concurrency=16, episodes=64,
                                      paced_episodes=32)
    assert result["multi_turn_episodes"]["rollouts"] == 64
    assert result["multi_turn_episodes_on_loop"]["rollouts"] == 64
    assert result["multi_turn_single_turn_rollouts"]["rollouts"] == 64 * TURNS
    assert result["multi_turn_episodes_paced"]["rollouts"] == 32
    assert all(result[k] > 0 for k in ("multi_turn_overhead_ratio", "multi_turn_overhead_ratio_on_loop",
                                       "multi_turn_overhead_ratio_paced"))
    # Each zero-latency ratio is the median of its paired measurements, and the median pair's figures are shown.
    import statistics

    for key in ("multi_turn_overhead_ratio", "multi_turn_overhead_ratio_on_loop"):
        assert len(result[f"{key}_pairs"]) == 3 and result[key] == statistics.median(result[f"{key}_pairs"])
    shown = result["multi_turn_episodes"]["rollouts_per_s"] / (result["multi_turn_single_turn_rollouts"]["rollouts_per_s"] / TURNS)
    assert shown == result["multi_turn_overhead_ratio"]


async def test_the_turns_reply_text_is_decoded_where_the_environments_step_runs_not_on_the_runs_loop(rl_model):
    """The assistant message of a turn is in the episode's messages when `step` sees it, and its text
    was decoded on the thread the step runs on (a plain step: its worker thread), not the loop's."""
    import threading

    import anyio

    from orchestrator.tasks.env import _after_the_reply
    from orchestrator.tasks.turns import TurnRenderer
    from orchestrator.tasks.user_code import UserCode
    from transformers import AutoTokenizer

    renderer = TurnRenderer(AutoTokenizer.from_pretrained(str(rl_model)))
    ids = renderer.encode("Write 4 digits: 1234")
    decoded_on: list[str] = []
    original = renderer.decode

    def decode(token_ids):
        decoded_on.append(threading.current_thread().name)
        return original(token_ids)

    renderer.decode = decode
    seen = {}

    def step(episode):
        seen["messages"] = list(episode.messages)
        seen["thread"] = threading.current_thread().name
        return [], 1.0, True

    class Ep:
        messages = [{"role": "user", "content": "hi"}]

    runner = UserCode(threads=2)
    wrapped = _after_the_reply(step, renderer, ids)
    assert wrapped.__name__ == "step"
    result = await runner.call(wrapped, Ep(), timeout_s=30, what="the environment's step")
    assert result == ([], 1.0, True)
    assert seen["messages"][-1] == {"role": "assistant", "content": original(renderer.reply_ids(ids))}
    assert decoded_on == [seen["thread"]] and seen["thread"] != threading.current_thread().name
    # The text is the tokenizer's own decode of the same ids.
    assert original(ids) == renderer.tokenizer.decode(ids, skip_special_tokens=False)
    await anyio.sleep(0)
