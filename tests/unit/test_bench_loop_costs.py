"""`inflight bench orchestrator`'s account of where a rollout's time goes (orchestrator/bench/
loop_costs.py): each thread's CPU a rollout by role, and the loop's fixed cost a rollout against
its cost a chunk. Figures, not asserted times: the rows have their keys, the roles are the
threads that did the work, and one chunk a rollout is what the fake engine then sends."""

from __future__ import annotations

import threading

import pytest

from orchestrator.bench.loop_costs import cpu_by_role, loop_split, thread_cpu_s
from orchestrator.bench.orchestrator import TOKENS, bare_rate, fake_engine, orchestrator_rate
from orchestrator.engines.base import SamplingSettings


def test_cpu_by_role_adds_each_threads_cpu_in_the_window_by_role():
    before = {1: ("loop", 1.0), 2: ("replay_writer", 0.5), 3: ("journal", 0.2)}
    after = {1: ("loop", 1.5), 2: ("replay_writer", 0.75), 4: ("journal", 0.1), 5: ("journal", 0.05)}
    # 3 ended during the run (missing); 4 and 5 started during it (all their CPU is in the window)
    assert cpu_by_role(before, after, 1000) == pytest.approx(
        {"loop": 500.0, "replay_writer": 250.0, "journal": 150.0})
    assert cpu_by_role(None, after, 1000) is None  # no /proc: absent, not zero
    assert cpu_by_role(before, after, 0) is None


def test_threads_are_named_by_their_role_and_their_cpu_grows():
    spin = threading.Event()

    def work() -> None:
        while not spin.is_set():
            sum(range(1000))

    worker = threading.Thread(target=work, name="replay-writer")
    first = thread_cpu_s()
    worker.start()
    try:
        threading.Event().wait(0.2)
        second = thread_cpu_s()
    finally:
        spin.set()
        worker.join()
    assert first is not None and second is not None
    assert second[threading.main_thread().native_id][0] == "loop"
    assert second[0][0] == "process" and second[0][1] >= second[worker.native_id][1]
    assert worker.native_id not in first
    assert second[worker.native_id][0] == "replay_writer"
    assert second[worker.native_id][1] > 0.0
    assert cpu_by_role(first, second, 1)["replay_writer"] > 0.0


async def test_one_chunk_a_rollout_is_what_the_fake_engine_sends():
    engine = fake_engine("one", chunk=TOKENS)
    chunks = [c async for c in engine.generate("r", [1], SamplingSettings(max_tokens=TOKENS))]
    assert len(chunks) == 1 and len(chunks[0].token_ids) == TOKENS and chunks[0].finished
    streamed = [c async for c in fake_engine("many").generate("r", [1], SamplingSettings(max_tokens=TOKENS))]
    assert len(streamed) == 32 and sum(len(c.token_ids) for c in streamed) == TOKENS


async def test_the_loop_rows_name_the_threads_and_split_the_cost():
    streamed = await orchestrator_rate(16, 256)
    by_thread = streamed["cpu_us_per_rollout_by_thread"]
    assert by_thread["loop"] > 0 and by_thread["replay_writer"] > 0  # the writer wrote every record
    assert by_thread["process"] >= by_thread["loop"] + by_thread["replay_writer"]
    bare = await bare_rate(16, 256)
    out = await loop_split(orchestrator_rate, bare_rate, 256, TOKENS, 16, streamed, bare, concurrency=16)
    split = out["loop_split_c16"]
    assert split["chunks_per_rollout"] == 32
    assert set(split) >= {"fixed_us_per_rollout", "loop_us_per_chunk", "bare_us_per_chunk",
                          "loop_us_per_rollout_one_chunk", "bare_us_per_rollout_one_chunk"}
    assert out["orchestrator_c16_one_chunk"]["rollouts"] >= 256
    assert out["orchestrator_c16_one_chunk"]["records"] >= out["orchestrator_c16_one_chunk"]["rollouts"]
    one = await loop_split(orchestrator_rate, bare_rate, 256, TOKENS, TOKENS, streamed, bare, concurrency=16)
    assert "loop_us_per_chunk" not in one["loop_split_c16"]  # one chunk already: nothing a chunk to tell


async def test_the_ablations_take_out_one_feature_each_and_the_full_loop_writes_every_record():
    full = await orchestrator_rate(16, 256, record_build=True)
    assert full["records"] >= full["rollouts"] and full["record_build_us"] > 0
    unwritten = await orchestrator_rate(16, 256, recording=False)
    assert unwritten["records"] == 0 and unwritten["rollouts"] >= 256  # the loop ran whole, nothing written
    assert unwritten["cpu_us_per_rollout_by_thread"].get("replay_writer", 0.0) == 0.0  # no writer thread
    rarer = await orchestrator_rate(16, 256, batch_scale=8)
    assert rarer["rollouts"] >= 256 and rarer["rollouts"] % (16 * 8) == 0  # whole batches eight times as large
    from orchestrator.bench.loop_costs import ABLATIONS, loop_ablations

    neither = await orchestrator_rate(16, 256, **ABLATIONS["neither_written_nor_scored_off_loop"])
    assert neither["records"] == 0 and not neither["cpu_us_per_rollout_by_thread"].get("scoring")  # no scoring thread
    out = (await loop_ablations(orchestrator_rate, bare_rate, 256, rounds=1, concurrency=16))["loop_ablations_c16"]
    assert set(ABLATIONS) == {"full", "scoring_inline", "records_not_written", "steps_8x_rarer",
                              "neither_written_nor_scored_off_loop"}
    for name in ABLATIONS:
        assert out[f"{name}_us"] > 0
        assert out[f"{name}_ratio"] == pytest.approx(out["bare_us"] / out[f"{name}_us"])  # as overhead_ratio_c64
        if name != "full":
            assert out[f"{name}_saves_us"] == pytest.approx(out["full_us"] - out[f"{name}_us"])
    assert out["record_build_us"] > 0 and out["rounds"] == 1 and out["bare_us"] > 0


def test_a_bad_number_of_ablation_rounds_is_refused_naming_it():
    import argparse

    from orchestrator.bench.loop_costs import ablation_rounds

    assert ablation_rounds("3") == 3 and ablation_rounds("0") == 0
    for bad in ("-1", "x", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad) if not bad.startswith("-") else "-1"):
            ablation_rounds(bad)
