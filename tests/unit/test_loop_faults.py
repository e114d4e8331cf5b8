"""The run loop (`orchestrator.run.loop.RunLoop`) with the benchmark's zero-latency fake engine and
instant fake trainer, and injected faults: every dispatched rollout still ends in exactly one
terminal record, whatever stops it. Real replay log, real journal, real scheduler and fleet."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.bench.orchestrator import TOKENS, BenchRun, fake_engine
from orchestrator.errors import EngineGenerateError
from orchestrator.fleet.fleet import Fleet
from orchestrator.run.loop import RunLoop
from orchestrator.run.resume import read_journal
from replay.log import read_records
from replay.records import ConsumptionRecord, DiscardRecord, RolloutRecord


def make_run(tmp_path, fail_every: int = 0, tokens_delay: float = 0.0, grace_s: float = 30.0,
             stall_s: float = 600.0):
    import msgspec

    run = BenchRun(tmp_path, concurrency=32, rollouts=32 * 6)
    run.config = msgspec.structs.replace(
        run.config, run=msgspec.structs.replace(run.config.run, shutdown_grace_s=grace_s, stall_s=stall_s))
    engine = fake_engine("fake-0")
    inner = engine.generate
    count = [0]

    async def generate(request_id, prompt_token_ids, sampling, cache_salt=None, final_only=False):
        count[0] += 1
        if fail_every and count[0] % fail_every == 0:
            raise EngineGenerateError("fake-0", "injected failure")
        async for chunk in inner(request_id, prompt_token_ids, sampling, cache_salt, final_only):
            if tokens_delay:
                await anyio.sleep(tokens_delay)
            yield chunk

    engine.generate = generate
    run.fleet = Fleet([engine])
    run.loop = RunLoop(run)
    return run


def mid_stream(run) -> bool:
    """A rollout streams with at least half of its tokens still to come."""
    return any(0 < t.n_tokens <= TOKENS // 2 for t in run.fleet.tracks.values())


async def drive(run, stop_after_s: float | None = None, stop_mid_stream: bool = False):
    """Run the loop to its end; with `stop_after_s`, ask it to stop after that long (and, with
    `stop_mid_stream`, then at the first moment a rollout is mid-stream: the loop pauses
    between waves of rollouts, and a stop in such a gap would find nothing in flight)."""
    async with anyio.create_task_group() as tg:
        if stop_after_s is not None:
            async def stopper():
                await anyio.sleep(stop_after_s)
                while stop_mid_stream and not mid_stream(run):
                    await anyio.sleep(0.001)
                run.loop.request_stop("test")
            tg.start_soon(stopper)
        with anyio.fail_after(120):
            await run.loop.main(run.scheduler.start())
        tg.cancel_scope.cancel()
    await run.recorder.flush()
    run.recorder.close()
    run.journal.close()


def check(run_dir):
    records = list(read_records(run_dir))
    rollouts = [r for r in records if isinstance(r, RolloutRecord)]
    ids = [r.rollout_id for r in rollouts]
    assert len(ids) == len(set(ids)), "two terminal records for one rollout"
    assert set(ids) == set(read_journal(run_dir)), "a dispatched rollout without its terminal record"
    consumed = [rid for c in records if isinstance(c, ConsumptionRecord) for rid in c.rollout_ids]
    discarded = [rid for c in records if isinstance(c, DiscardRecord) for rid in c.rollout_ids]
    assert len(consumed) == len(set(consumed)) and not set(consumed) & set(discarded)
    by_id = {r.rollout_id: r for r in rollouts}
    assert all(by_id[rid].status_name == "completed" for rid in consumed + discarded)
    return records, rollouts


@pytest.mark.timeout(180)
async def test_failing_requests_are_errored_replaced_and_the_run_completes(tmp_path):
    run = make_run(tmp_path, fail_every=7)
    await drive(run)
    records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps == run.max_steps
    errored = [r for r in rollouts if r.status_name == "errored"]
    assert errored and {r.status.kind for r in errored} == {"engine_generate_error"}


@pytest.mark.timeout(180)
async def test_a_stop_past_its_grace_gives_every_rollout_in_flight_its_terminal_record(tmp_path):
    run = make_run(tmp_path, tokens_delay=0.01, grace_s=0.05)  # the fake ignores aborts: cancelled
    # A rollout with half its tokens to come needs far longer than the grace to finish.
    await drive(run, stop_after_s=0.5, stop_mid_stream=True)
    records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps < run.max_steps
    dropped = [r for r in rollouts if r.status_name == "dropped"]
    assert dropped and {r.status.reason for r in dropped} == {"shutdown"}
    # rollouts stopped mid-stream keep the tokens they had: real data, never padded
    assert all(r.num_completion_tokens < 500 for r in dropped)


@pytest.mark.timeout(180)
async def test_a_stop_within_its_grace_lets_rollouts_finish(tmp_path):
    run = make_run(tmp_path, tokens_delay=0.005)
    await drive(run, stop_after_s=0.5)
    records, rollouts = check(tmp_path)
    assert rollouts and all(r.status_name == "completed" for r in rollouts)


@pytest.mark.timeout(180)
async def test_a_reward_that_always_raises_stops_the_run_naming_it(tmp_path):
    """The past miss: every group dropped after its retries, new ones admitted, no step, no end."""
    from orchestrator.scoring.outcome import REWARD_ERROR, ScoreFailed

    class AlwaysRaises:
        async def score(self, prompt, completion_token_ids):
            raise ScoreFailed(REWARD_ERROR, "reward fail_always: ValueError: no reward for you")

        async def aclose(self):
            pass

    run = make_run(tmp_path, stall_s=1.0)
    run.scorer = AlwaysRaises()
    await drive(run)  # ends by itself: the guard's stop
    records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps == 0 and run.loop.stop_reason == "no progress"
    failure = run.loop.failure
    # stall_s = 1 bounds all_errored_s too: either bound may speak first, each naming the kind
    assert ("of the last" in failure or "rollouts all errored" in failure) and "errored(reward_error)" in failure, \
        failure
    assert "reward fail_always: ValueError: no reward for you" in failure and "orchestrator.jsonl" in failure
    assert all(r.status_name != "completed" for r in rollouts)


@pytest.mark.timeout(180)
async def test_a_completion_cut_by_max_tokens_is_scored_and_recorded_with_finish_reason_length(tmp_path):
    from replay.query import stats_from_log

    run = make_run(tmp_path)
    engine = run.fleet.engines["fake-0"]
    inner, said = engine.generate, {}

    async def generate(request_id, prompt_token_ids, sampling, cache_salt=None, final_only=False):
        # every third request stops on its own; the rest are cut at max_tokens (the fake's way)
        reason = "stop" if len(said) % 3 == 0 else "length"
        said[request_id] = reason
        async for chunk in inner(request_id, prompt_token_ids, sampling, cache_salt, final_only):
            if chunk.finished:
                chunk.finish_reason = reason
            yield chunk

    engine.generate = generate
    await drive(run)
    _records, rollouts = check(tmp_path)
    assert run.scheduler.done_steps == run.max_steps and all(r.status_name == "completed" for r in rollouts)
    assert [r.finish_reason for r in rollouts] == [said[f"rollout-{r.rollout_id}"] for r in rollouts]
    assert all("reward" in r.rewards for r in rollouts), "a cut completion is scored like any other"
    cut = sum(r.finish_reason == "length" for r in rollouts)
    assert 0 < cut < len(rollouts)
    assert stats_from_log(tmp_path)["truncated_share"] == pytest.approx(cut / len(rollouts))


class SlowRows:
    """FixedTask's prompt, each taking a while (a row read by the task's code on a thread), and
    counting how many are being read at once; row `fail_at` raises."""

    def __init__(self, task, fail_at: int | None = None) -> None:
        self.task, self.fail_at = task, fail_at
        self.reading = self.most_at_once = 0
        self.rows = None

    async def prompt(self, index: int):
        self.reading += 1
        self.most_at_once = max(self.most_at_once, self.reading)
        try:
            await anyio.sleep(0.05)
            if index == self.fail_at:
                raise LookupError(f"row {index} is missing")
            return await self.task.prompt(index)
        finally:
            self.reading -= 1

    def score_sync(self, prompt, completion_token_ids):
        return self.task.score_sync(prompt, completion_token_ids)


async def test_the_prompts_of_a_wave_of_new_groups_are_read_together(tmp_path):
    run = make_run(tmp_path)
    run.task = SlowRows(run.task)  # 32 in flight: four groups of 8 a wave
    await drive(run)
    check(tmp_path)
    assert run.task.most_at_once >= 4, "the groups of a wave waited for each other's rows"
    assert run.scheduler.done_steps == run.max_steps


async def test_a_row_that_fails_among_others_read_together_stops_the_run_with_its_own_error(tmp_path):
    run = make_run(tmp_path)
    run.task = SlowRows(run.task, fail_at=2)
    with pytest.raises(BaseException) as raised:
        await drive(run)
    errors = raised.value.exceptions if isinstance(raised.value, BaseExceptionGroup) else [raised.value]
    while any(isinstance(e, BaseExceptionGroup) for e in errors):
        errors = [x for e in errors for x in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e])]
    assert [str(e) for e in errors] == ["row 2 is missing"]


async def test_a_row_that_failed_in_a_wave_is_asked_for_again_later_not_remembered(tmp_path):
    from orchestrator.scheduling import scheduler as sch

    run = make_run(tmp_path)
    rows = run.task = SlowRows(run.task, fail_at=1)
    batch = [sch.Dispatch(rollout_id=g * sch.ROLLOUT_ID_STRIDE, group_id=g, engine="fake-0", version=0)
             for g in (0, 1, 2)]
    with pytest.raises(LookupError, match="row 1 is missing"):
        await run.loop._fetch_prompts(batch)
    assert set(run.loop.prompts) == {0, 2}
    rows.fail_at = None  # a transient failure: a later read (a stop's records) asks the task again
    from orchestrator.run.records import InFlight

    run.loop.inflight[batch[1].rollout_id] = InFlight(batch[1], 0.0)
    assert (await run.loop._context(batch[1].rollout_id)).prompt_id == "bench"
    assert set(run.loop.prompts) == {0, 1, 2}
    run.recorder.close()
    run.journal.close()
