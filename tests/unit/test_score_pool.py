"""The process pool for scoring (orchestrator/scoring/pool.py): real worker processes, built by
picklable builders from tests/score_pool_tasks.py (and one by the real `make_task`)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from orchestrator.errors import ConfigError
from orchestrator.scoring.pool import ScorePool
from orchestrator.scoring.scorer import REWARD_ERROR, REWARD_TIMEOUT, ScoreFailed, Scorer, make_scorer
from tests.score_pool_tasks import CommandTask, big_builder, config_error_builder, crashing_builder

ROOT = Path(__file__).resolve().parents[2]


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _named(prefix: str) -> list[int]:
    """Live processes whose name (`ps -o comm`, set by the worker) starts with `prefix`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith(prefix) and _alive(int(entry)):
                found.append(int(entry))
    return found


async def _wait_for(predicate, what: str, limit_s: float = 30.0) -> None:
    with anyio.fail_after(limit_s):
        while not predicate():
            await anyio.sleep(0.02)


def _pool(name: str, workers: int = 1, timeout_s: float = 30.0, offset: float = 0.0) -> ScorePool:
    return ScorePool(functools.partial(CommandTask, offset), workers=workers, timeout_s=timeout_s, name=name)


async def _whoami(pool: ScorePool) -> int:
    return int((await pool.score({"do": "whoami"}, [1]))["pid"])


@pytest.mark.slow  # the worker imports transformers and loads the tokenizer (seconds)
async def test_scores_equal_the_thread_scorers_with_the_real_task_builder(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from orchestrator.config.run import TaskConfig
    from orchestrator.tasks import make_task

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "say 7", "answer": "7"}\n{"prompt": "say 12", "answer": "12"}\n')
    config = TaskConfig(dataset=str(data), rewards=[{"fn": "exact"}, {"fn": "regex", "pattern": "\\d", "weight": 0.5}]
                        ).validate()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task(config, str(tiny_model_dir), tokenizer=tokenizer)
    threads = Scorer(task, workers=2, timeout_s=30)
    pool = ScorePool(functools.partial(make_task, config, str(tiny_model_dir)), workers=1, timeout_s=30,
                     name="spt-real")
    await pool.start()
    try:
        cases = [(await task.prompt(i), tokenizer.encode(text, add_special_tokens=False))
                 for i in range(2) for text in ("7", "12", "no digits")]
        with anyio.fail_after(60):
            got = [await pool.score(prompt, ids) for prompt, ids in cases]
        want = [await threads.score(prompt, ids) for prompt, ids in cases]
    finally:
        await pool.aclose()
    assert got == want
    assert {s["reward"] for s in got} == {0.0, 0.5, 1.5}  # each case scored, not one answer repeated


async def test_an_exception_is_a_one_line_reward_error_and_the_worker_is_kept():
    pool = _pool("spt-raise")
    await pool.start()
    try:
        before = await _whoami(pool)
        with pytest.raises(ScoreFailed) as err:
            await pool.score({"do": "raise"}, [1])
        assert (err.value.kind, err.value.message) == (REWARD_ERROR, "ValueError: no digits in the completion")
        with pytest.raises(ScoreFailed) as err:
            await pool.score({"do": "nan"}, [1])
        assert err.value.kind == REWARD_ERROR and "not a finite number" in err.value.message
        assert await _whoami(pool) == before
    finally:
        await pool.aclose()


async def test_a_job_larger_than_a_pipe_holds_goes_through():
    pool = _pool("spt-large")
    await pool.start()
    try:
        ids = list(range(100_000))  # ~300 KB pickled, a pipe holds 64 KB
        assert await pool.score({"do": "sum", "row": "x" * (1 << 20)}, ids) == {
            "reward": float(sum(ids)), "count": float(len(ids))}
    finally:
        await pool.aclose()


async def test_a_hung_call_times_out_its_process_is_killed_and_the_next_call_works():
    pool = _pool("spt-hang", timeout_s=0.5, offset=0.25)
    await pool.start()
    try:
        hung = await _whoami(pool)
        with anyio.fail_after(30), pytest.raises(ScoreFailed) as err:
            await pool.score({"do": "hang"}, [1])
        assert err.value.kind == REWARD_TIMEOUT and "score_timeout_s (0.5 s)" in err.value.message
        assert _state(hung) is None  # killed and reaped: not even a zombie
        assert await pool.score({"do": "sum"}, [2, 3]) == {"reward": 5.25, "count": 2.0}
        assert await _whoami(pool) != hung
    finally:
        await pool.aclose()


async def test_a_worker_killed_for_its_timeout_is_replaced_by_the_spare_built_ahead():
    pool = _pool("spt-spare", timeout_s=0.5)
    await pool.start()
    try:
        spare = pool.spare_pid
        assert spare is not None and spare not in pool.pids and _alive(spare)
        await _wait_for(lambda: pool.spare_answered, "the spare to build its task")
        hung = await _whoami(pool)
        with anyio.fail_after(30), pytest.raises(ScoreFailed) as err:
            await pool.score({"do": "hang"}, [1])
        assert err.value.kind == REWARD_TIMEOUT and _state(hung) is None
        # The next call runs in the spare, built before the hang: no build between the two.
        assert await _whoami(pool) == spare and pool.pids == [spare]
        assert pool.spare_pid not in (None, spare, hung) and _alive(pool.spare_pid)
    finally:
        await pool.aclose()
    assert not _named("spt-spare")


async def test_a_spare_that_died_while_it_waited_is_not_used_and_no_spare_is_kept_when_asked():
    pool = _pool("spt-spare-dead")
    await pool.start()
    try:
        spare = pool.spare_pid
        await _wait_for(lambda: pool.spare_answered, "the spare to build its task")  # built, then dead
        os.kill(spare, signal.SIGKILL)
        await _wait_for(lambda: _state(spare) in (None, "Z"), "the spare to die")
        with pytest.raises(ScoreFailed):
            await pool.score({"do": "exit"}, [1])  # its worker dies: the next call needs a new one
        replacement = await _whoami(pool)
        assert replacement != spare and _alive(replacement)
        assert pool.spare_pid not in (None, spare, replacement)  # and a new spare builds
    finally:
        await pool.aclose()
    plain = ScorePool(functools.partial(CommandTask), workers=1, timeout_s=5, name="spt-nospare", spare=False)
    await plain.start()
    try:
        assert plain.spare_pid is None
        with pytest.raises(ScoreFailed):
            await plain.score({"do": "exit"}, [1])
        assert await plain.score({"do": "sum"}, [3]) == {"reward": 3.0, "count": 1.0}
        assert plain.spare_pid is None and len(_named("spt-nospare")) == 1
    finally:
        await plain.aclose()


async def test_a_call_cancelled_while_the_next_spare_is_sent_its_builder_leaves_no_half_built_spare():
    # The builder (300 kB) is larger than a pipe holds: sending it waits for the new process to read.
    pool = ScorePool(functools.partial(big_builder, b"x" * 300_000), workers=1, timeout_s=30,
                     name="spt-spare-cut", start_timeout_s=30)
    await pool.start()
    try:
        await _wait_for(lambda: pool.spare_answered, "the spare to build its task")
        first_spare = pool.spare_pid
        with pytest.raises(ScoreFailed):
            await pool.score({"do": "exit"}, [1])  # the slot's worker dies: the next call takes the spare
        with anyio.move_on_after(0.01) as scope:  # ... and is cancelled while the next spare's builder is sent
            await pool.score({"do": "sum"}, [1])
        assert scope.cancelled_caught
        # Neither the spare it took (a cancelled call kills its worker) nor a half-sent one is kept.
        assert pool.spare_pid is None and pool.pids == []
        await _wait_for(lambda: not _alive(first_spare), "the taken spare to die")
        assert await pool.score({"do": "sum"}, [2]) == {"reward": 3.0, "count": 1.0}  # a fresh build, whole
    finally:
        await pool.aclose()
    assert not _named("spt-spare-cut")


async def test_a_call_that_waited_for_a_slot_starts_no_worker_once_the_pool_is_closed():
    pool = _pool("spt-closed-wait")
    await pool.start()
    results: list[object] = []

    async def call(prompt) -> None:
        try:
            results.append(await pool.score(prompt, [1]))
        except ScoreFailed as exc:
            results.append(exc.message)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, {"do": "hang"})
            await anyio.sleep(0.2)
            tg.start_soon(call, {"do": "sum"})  # waits for the only slot
            await anyio.sleep(0.1)
            await pool.aclose()
    assert sorted(map(str, results)) == ["the scoring pool is closed",
                                         "the scoring pool was closed during the call"]
    assert pool.pids == [] and pool.spare_pid is None and not _named("spt-closed-wait")


async def test_a_worker_that_dies_mid_call_is_a_reward_error_and_is_replaced(tmp_path):
    pool = _pool("spt-die")
    await pool.start()
    try:
        marker = tmp_path / "busy"
        failures: list[ScoreFailed] = []

        async def call() -> None:
            try:
                await pool.score({"do": "hang", "marker": str(marker)}, [1])
            except ScoreFailed as exc:
                failures.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await _wait_for(marker.exists, "the call to start")
                os.kill(int(marker.read_text()), signal.SIGKILL)
        assert [(f.kind, f.message) for f in failures] == [
            (REWARD_ERROR, "the scoring worker died (exit code -9, SIGKILL)")]
        with pytest.raises(ScoreFailed) as err:
            await pool.score({"do": "exit"}, [1])
        assert err.value.message == "the scoring worker died (exit code 7)"
        assert await pool.score({"do": "sum"}, [4]) == {"reward": 4.0, "count": 1.0}
    finally:
        await pool.aclose()


async def test_at_most_workers_calls_run_at_once():
    pool = _pool("spt-bound", workers=2)
    await pool.start()
    results: list[dict] = []

    async def call() -> None:
        results.append(await pool.score({"do": "slow", "seconds": 0.3}, [1]))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(call)
    finally:
        await pool.aclose()
    assert len(results) == 6 and len({r["pid"] for r in results}) == 2
    # Worker-side intervals (one machine-wide monotonic clock): at no start were more than 2 running.
    most = max(sum(1 for o in results if o["start"] <= r["start"] < o["end"]) for r in results)
    assert most == 2


async def test_a_cancelled_call_kills_its_worker_and_the_next_call_gets_its_own_answer(tmp_path):
    pool = _pool("spt-cancel")
    await pool.start()
    try:
        marker = tmp_path / "busy"
        with anyio.fail_after(30):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pool.score, {"do": "slow", "seconds": 0.5, "marker": str(marker)}, [1])
                    await _wait_for(marker.exists, "the call to start")
                    scope.cancel()
        assert scope.cancelled_caught
        busy = int(marker.read_text())
        # The slow call's answer ({"reward": 1.0, "start": ...}) would come within 0.5 s: this one's must.
        assert await pool.score({"do": "sum"}, [5, 6]) == {"reward": 11.0, "count": 2.0}
        await _wait_for(lambda: not _alive(busy), "the cancelled call's worker to die")

        # A call cancelled while it waits for a worker gives its place back.
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.score, {"do": "slow", "seconds": 0.3}, [1])
            with anyio.move_on_after(0.05):
                await pool.score({"do": "sum"}, [1])
        assert await pool.score({"do": "sum"}, [7]) == {"reward": 7.0, "count": 1.0}
    finally:
        await pool.aclose()


async def test_aclose_stops_every_worker_even_busy_or_cancelled():
    pool = _pool("spt-close", workers=3)
    await pool.start()
    pids = pool.pids
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    failures: list[ScoreFailed] = []

    async def hang() -> None:
        try:
            await pool.score({"do": "hang"}, [1])
        except ScoreFailed as exc:
            failures.append(exc)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hang)
            await anyio.sleep(0.2)
            await pool.aclose()
    assert not any(_alive(p) for p in pids) and not _named("spt-close")
    assert len(failures) == 1 and failures[0].kind == REWARD_ERROR
    await pool.aclose()  # idempotent
    with pytest.raises(ScoreFailed, match="closed"):
        await pool.score({"do": "sum"}, [1])

    other = _pool("spt-close2", workers=2)
    await other.start()
    pids = [*other.pids, other.spare_pid]
    with anyio.CancelScope() as scope:
        scope.cancel()
        await other.aclose()  # shielded: it still stops them
    assert pids and not any(_alive(p) for p in pids)


@pytest.mark.parametrize(("builder", "field", "words"), [
    (config_error_builder, "task.rewards[0].fn", "cannot import 'nope': ModuleNotFoundError"),
    (crashing_builder, "eval", "building the task in a scoring process failed: RuntimeError: the builder blew up"),
    (lambda: CommandTask(), "eval", "the task cannot be sent to a scoring process"),
])
async def test_a_builder_that_fails_stops_start_named_and_leaves_no_process(builder, field, words):
    pool = ScorePool(builder, workers=2, timeout_s=5, name="spt-build", where="eval")
    with anyio.fail_after(60), pytest.raises(ConfigError) as err:
        await pool.start()
    assert err.value.field == field and words in err.value.reason and "\n" not in str(err.value)
    assert not _named("spt-build")


async def test_workers_ignore_sigint_in_a_group_of_their_own():
    pool = _pool("spt-sigint", workers=2)
    await pool.start()
    try:
        for pid in pool.pids:
            assert os.getpgid(pid) != os.getpgid(0)  # a terminal's Ctrl-C does not reach them
            os.kill(pid, signal.SIGINT)  # and one sent to them directly is ignored
        await anyio.sleep(0.2)
        assert all(_alive(p) for p in pool.pids)
        assert await pool.score({"do": "sum"}, [1]) == {"reward": 1.0, "count": 1.0}
    finally:
        await pool.aclose()


async def test_workers_die_with_a_killed_orchestrator():
    code = ("import anyio, functools, sys, time\n"
            "from orchestrator.scoring.pool import ScorePool\n"
            "from tests.score_pool_tasks import CommandTask\n"
            "async def main():\n"
            "    pool = ScorePool(functools.partial(CommandTask), workers=2, timeout_s=5, name='spt-orphan')\n"
            "    await pool.start()\n"
            "    print(*pool.pids, pool.spare_pid, flush=True)\n"
            "    await anyio.sleep(600)\n"
            "anyio.run(main)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = await anyio.to_thread.run_sync(parent.stdout.readline)
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)  # two workers and the spare
        parent.kill()  # no aclose, no atexit: only the parent-death signal and the pipes' EOF are left
        parent.wait()
        await _wait_for(lambda: not any(_alive(p) for p in pids), "the orphaned workers to die")
    finally:
        parent.kill()
        parent.wait()


async def test_make_scorer_builds_the_configured_kind(tmp_path):
    from orchestrator.config.run import TaskConfig, load_config

    assert TaskConfig().score_pool == "auto" and TaskConfig().scoring_pool == "thread"  # a built-in toy
    assert TaskConfig(dataset="d.jsonl").scoring_pool == "process"  # the user's code
    assert TaskConfig(dataset="d.jsonl", score_pool="thread").scoring_pool == "thread"
    task = CommandTask()
    assert isinstance(make_scorer(task, pool="thread", workers=1, timeout_s=1), Scorer)
    pool = make_scorer(task, pool="process", workers=1, timeout_s=1, builder=CommandTask)
    assert isinstance(pool, ScorePool)
    with pytest.raises(ValueError, match="builder"):
        make_scorer(task, pool="process", workers=1, timeout_s=1)
    with pytest.raises(ConfigError) as err:
        make_scorer(task, pool="fork", workers=1, timeout_s=1, where="eval")
    assert err.value.field == "eval.score_pool"
    path = tmp_path / "c.toml"
    path.write_text('[task]\nscore_pool = "threads"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.field == "task.score_pool"


_HUNG_SCORER = """
import anyio, threading, time
from orchestrator.scoring.scorer import REWARD_TIMEOUT, ScoreFailed, Scorer

class Task:
    def score_sync(self, prompt, ids):
        if prompt == "hang":
            time.sleep(3600)  # a reward that never returns
        return {"reward": float(len(ids))}

async def main():
    scorer = Scorer(Task(), workers=1, timeout_s=0.5)
    try:
        await scorer.score("hang", [1])
    except ScoreFailed as exc:
        assert exc.kind == REWARD_TIMEOUT, exc
    # the abandoned call gave its slot back: the next ones run, on one reused thread
    assert [await scorer.score("ok", [1, 2]) for _ in range(5)] == [{"reward": 2.0}] * 5
    names = [t.name for t in threading.enumerate() if t.name == "inflight-score"]
    print("threads", len(names))

anyio.run(main)
print("main done")
"""


def test_a_thread_scorer_whose_reward_never_returns_lets_the_process_exit(tmp_path):
    """anyio's worker threads are not daemons: Python joined the hung one at exit, forever."""
    import subprocess
    import sys

    script = tmp_path / "hung.py"
    script.write_text(_HUNG_SCORER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "threads 2" in done.stdout and "main done" in done.stdout, done.stdout  # the hung one + one reused


async def test_a_thread_scorers_timeout_counts_the_call_not_its_wait_for_a_thread():
    """Eight calls of 0.3 s on one thread with a 1 s timeout: each is within its time, though the
    last waits about 2 s for the thread (counting the wait, an evaluation's burst of samples timed
    out behind one another)."""
    import time

    class Slow:
        def score_sync(self, prompt, ids):
            time.sleep(0.3)
            return {"reward": 1.0}

    scorer = Scorer(Slow(), workers=1, timeout_s=1.0)
    results = []

    async def one():
        results.append(await scorer.score("p", [1]))

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(one)
    assert results == [{"reward": 1.0}] * 8


async def test_one_timer_bounds_every_call_from_its_own_start():
    """The scorer keeps one timer a loop for all its calls: a call started after that timer was
    set (by an earlier, quick one) still fails at its own time, never before it, and quick calls
    beside it are untouched."""
    import threading
    import time

    release = threading.Event()

    class Task:
        def score_sync(self, prompt, ids):
            if prompt == "hang":
                release.wait(30)  # hangs until the test ends
            return {"reward": float(len(ids))}

    scorer = Scorer(Task(), workers=4, timeout_s=0.5)
    try:
        assert await scorer.score("ok", [1]) == {"reward": 1.0}  # sets the timer, then finishes
        await anyio.sleep(0.3)
        outcomes: dict[str, object] = {}

        async def hung(name: str) -> None:
            started = time.monotonic()
            try:
                await scorer.score("hang", [1])
            except ScoreFailed as exc:
                outcomes[name] = (exc.kind, time.monotonic() - started)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hung, "first")
            await anyio.sleep(0.2)
            tg.start_soon(hung, "second")  # started after the first's: due later
            quick = [await scorer.score("ok", [1, 2]) for _ in range(3)]
        assert quick == [{"reward": 2.0}] * 3
        for name in ("first", "second"):
            kind, waited = outcomes[name]
            assert kind == REWARD_TIMEOUT, outcomes
            assert waited >= 0.5 * 0.98, outcomes  # never before its own timeout
    finally:
        release.set()
