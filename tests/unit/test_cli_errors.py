"""`inflight run` under misuse, before any engine starts: every user-facing failure exits 2 with
one line naming the setting, path or cause (no traceback; `--log-format json` gets one JSON error
event), a resume of a finished run exits 0 at once, and a run whose activations keep failing
stops with the cause while /healthz reports it degraded.

Everything here runs the real command in a subprocess (or the real run loop with the fake
engine and trainer of `inflight bench orchestrator`); nothing starts a vLLM engine.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from orchestrator.commands import cli
from orchestrator.config.run import RunConfig
from orchestrator.errors import ConfigError, ModelError

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

INFLIGHT = [sys.executable, "-m", "orchestrator.commands.cli"]


def inflight(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*INFLIGHT, *args], capture_output=True, text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("inflight: error:")]


def assert_one_named_error(out: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, exactly one `inflight: error:` line naming every one of `names`, no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = error_lines(out.stderr)
    assert len(lines) == 1, out.stderr[-3000:]
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def events(run_dir: Path) -> list[str]:
    log = run_dir / "orchestrator.jsonl"
    if not log.exists():
        return []
    return [json.loads(line)["event"] for line in log.read_text().splitlines() if line.startswith("{")]


# -- the CLI's sorting of exceptions -------------------------------------------------------------
def test_an_expected_error_inside_nested_exception_groups_exits_2_with_its_own_line(capsys):
    error = ConfigError("http.port", "in use")
    nested = BaseExceptionGroup("services", [ExceptionGroup("setup", [error])])
    assert cli.exit_code(nested) == 2
    assert capsys.readouterr().err.splitlines() == ["inflight: error: http.port: in use"]


def test_an_interrupt_anywhere_in_a_group_exits_130(capsys):
    group = BaseExceptionGroup("run", [ModelError("/m", "gone"), KeyboardInterrupt()])
    assert cli.exit_code(group) == 130
    assert "interrupted" in capsys.readouterr().err


def test_a_bug_beside_an_expected_error_is_not_hidden():
    group = ExceptionGroup("run", [ConfigError("a", "b"), ZeroDivisionError("bug")])
    assert cli.exit_code(group) is None  # main re-raises it: the traceback is the user's clue
    assert cli.exit_code(ZeroDivisionError("bug")) is None
    assert cli.exit_code(SystemExit(3)) is None


# -- config validation: what cannot train is refused, named ------------------------------------
@pytest.mark.parametrize(("text", "names"), [
    ("[sampling]\ntemperature = 0.0\n", ("sampling.temperature", "greedy")),
    ("[sampling]\nmin_tokens = 4\n", ("sampling.min_tokens", "truncates")),
    ("[trainer]\npublish_every = 6\n", ("trainer.publish_every", "scheduler.max_off_policy_steps = 4", "stall")),
    ("[activation]\nmax_failures = 0\n", ("activation.max_failures",)),
])
def test_a_setting_that_cannot_train_exits_2_naming_it(tmp_path, text, names):
    out = inflight("run", str(write(tmp_path / "bad.toml", text)), "--run-dir", str(tmp_path / "run"))
    assert_one_named_error(out, *names)
    assert not (tmp_path / "run" / "config.json").exists()


def test_publish_every_up_to_the_staleness_bound_plus_one_is_accepted():
    from orchestrator.config.run import SchedulerConfig, TrainerConfig

    RunConfig(trainer=TrainerConfig(publish_every=5), scheduler=SchedulerConfig(max_off_policy_steps=4)).validate()


def test_the_json_log_format_gets_one_json_error_event(tmp_path):
    out = inflight("--log-format", "json", "run", str(write(tmp_path / "bad.toml", "[sampling]\ntemperature = 0\n")),
                   "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert not error_lines(out.stderr)
    event = json.loads(out.stderr.strip().splitlines()[-1])
    assert event["event"] == "error" and event["kind"] == "ConfigError"
    assert event["error"].startswith("sampling.temperature:")


# -- set-up errors -------------------------------------------------------------------------------
def test_a_model_path_that_is_a_file_exits_2_naming_engine_model(tmp_path):
    model = write(tmp_path / "model.safetensors", "not a directory")
    config = write(tmp_path / "run.toml", f'[engine]\nmodel = "{model}"\n')
    out = inflight("run", str(config), "--run-dir", str(tmp_path / "run"))
    assert_one_named_error(out, "engine.model", str(model), "not a model directory")
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_model_directory_refused_during_set_up_exits_2_with_one_line(tmp_path):
    """Raised inside the run's task group (an ExceptionGroup on the way out), after the HTTP
    server and the watchdog started: still one line, and nothing left running."""
    model = tmp_path / "model"
    model.mkdir()
    write(model / "config.json", "{}")
    write(model / "inflight_model.json", json.dumps({"preset": "tiny", "seed": 0}))
    config = write(tmp_path / "run.toml", f'[engine]\nmodel = "{model}"\n[run]\nprogress = "plain"\n')
    out = inflight("run", str(config), "--run-dir", str(tmp_path / "run"))
    assert_one_named_error(out, str(model), "preset 'tiny'")
    assert "engine.starting" not in events(tmp_path / "run")


def test_a_chat_template_that_raises_exits_2_with_the_field_and_its_message_before_engines_start(tmp_path, checkout_rl_model):
    """The template is checked where the task is built, before any engine or trainer starts: its
    own message on one line, never a jinja2 traceback."""
    template = write(tmp_path / "strict.jinja", "{{ raise_exception('no ' + messages[0]['role'] + ' turns here') }}")
    model = Path(__file__).resolve().parents[2] / "models" / "tiny-rl"
    config = write(tmp_path / "run.toml", f'[engine]\nmodel = "{model}"\n[task]\nchat_template = "{template}"\n'
                                          '[run]\nprogress = "plain"\n')
    out = inflight("run", str(config), "--run-dir", str(tmp_path / "run"))
    assert_one_named_error(out, "task.chat_template", "no user turns here", str(template))
    assert "jinja2" not in out.stderr
    assert "engine.starting" not in events(tmp_path / "run")


def test_an_http_port_in_use_exits_2_naming_http_port_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = write(tmp_path / "run.toml", f'[engine]\nmodel = "{tmp_path / "model"}"\n[http]\nport = {port}\n')
        out = inflight("run", str(config), "--run-dir", str(tmp_path / "run"))
    assert_one_named_error(out, "http.port", str(port))
    # nothing started: no model built, no trainer, no engine; the same command can be rerun
    assert not (tmp_path / "model").exists()
    assert not {"engine.starting", "trainer.ready", "trainer.command"} & set(events(tmp_path / "run"))
    assert not (tmp_path / "run" / "config.json").exists()


def test_an_http_port_in_use_with_a_cluster_still_fails_before_anything_starts(tmp_path):
    """With `[cluster]` the server listens at the node's cluster address (loopback here); the port is
    still bound first: the run names it, never reaching the (absent) Ray cluster."""
    from tests.helpers import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = write(tmp_path / "run.toml", f'[engine]\nmodel = "{tmp_path / "model"}"\n[http]\nport = {port}\n'
                                              f'[cluster]\naddress = "127.0.0.1:{free_port()}"\n')
        out = inflight("run", str(config), "--run-dir", str(tmp_path / "run"))
    line = assert_one_named_error(out, "http.port", f"127.0.0.1:{port}")
    assert "cluster" not in line
    assert not (tmp_path / "model").exists() and not (tmp_path / "run" / "config.json").exists()


# -- resume ----------------------------------------------------------------------------------
def stored_run(run_dir: Path, config: RunConfig, steps_done: int) -> Path:
    """A run directory as a finished run leaves it: its config, a checkpoint per step (only the
    meta file is looked at), and a replay log consuming every step."""
    from replay.log import ReplayLog
    from replay.records import ConsumptionRecord

    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_bytes(msgspec.json.encode(config))
    for step in range(1, steps_done + 1):
        checkpoint = run_dir / "trainer" / f"step-{step:08d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "meta.json").write_text("{}")
    with ReplayLog.open(run_dir) as log:
        for step in range(1, steps_done + 1):
            log.append(ConsumptionRecord(step=step, rollout_ids=[step * 100], version=step))
    return run_dir


def refused_model(tmp_path: Path) -> Path:
    """A model directory the run refuses during its set-up (after it wrote its config)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    write(model / "config.json", "{}")
    write(model / "inflight_model.json", json.dumps({"preset": "tiny", "seed": 0}))
    return model


def test_a_run_that_stopped_in_its_set_up_leaves_its_directory_to_the_next_run(tmp_path):
    """A typo, a task that would not build, an engine that would not start: nothing was dispatched,
    recorded or published, so the corrected command on the same directory runs (its own config, a
    new run id), where it was refused as `already holds a run`."""
    model, run_dir = refused_model(tmp_path), tmp_path / "run"
    first = write(tmp_path / "first.toml", f'[engine]\nmodel = "{model}"\n[run]\nprogress = "plain"\n')
    assert_one_named_error(inflight("run", str(first), "--run-dir", str(run_dir)), "preset 'tiny'")
    assert (run_dir / "config.json").exists()
    first_id = (run_dir / "run_id").read_text()
    second = write(tmp_path / "second.toml", f'[engine]\nmodel = "{model}"\n[run]\nprogress = "none"\n')
    out = inflight("run", str(second), "--run-dir", str(run_dir))
    assert_one_named_error(out, "preset 'tiny'")  # its own set-up's error again, not --run-dir's
    assert json.loads((run_dir / "config.json").read_text())["run"]["progress"] == "none"
    assert (run_dir / "run_id").read_text() != first_id
    assert "run.dir_taken_over" in events(run_dir)


def test_a_directory_with_anything_of_a_run_is_refused_without_resume(tmp_path):
    from orchestrator.run.resume import JOURNAL
    from orchestrator.run.run import resolve_config

    recorded = stored_run(tmp_path / "recorded", RunConfig().validate(), 1)  # a record in its replay log
    journalled = tmp_path / "journalled"
    journalled.mkdir()
    (journalled / "config.json").write_bytes(msgspec.json.encode(RunConfig().validate()))
    (journalled / JOURNAL).write_text('[1000000, 1, "engine-0", 0, 1.0]\n')  # a dispatch, no record yet
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_bytes(msgspec.json.encode(RunConfig().validate()))
    (published / "weights" / "v00000001").mkdir(parents=True)
    for run_dir in (recorded, journalled, published):
        with pytest.raises(ConfigError, match="already holds a run; use --resume") as refused:
            resolve_config(None, run_dir, resume=False)
        assert refused.value.field == "--run-dir"
        out = inflight("run", "--run-dir", str(run_dir))
        assert_one_named_error(out, "--run-dir", str(run_dir), "already holds a run")
    assert resolve_config(None, recorded, resume=True) is not None  # --resume takes it


def test_a_run_in_progress_holds_its_directory_against_a_second_run_and_a_resume(tmp_path):
    from orchestrator.run.preflight import hold_run_dir, release_run_dir

    run_dir = stored_run(tmp_path / "run", RunConfig().validate(), 1)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    config = write(tmp_path / "run.toml", f'[engine]\nmodel = "{refused_model(tmp_path)}"\n')
    held = hold_run_dir(run_dir)
    held_fresh = hold_run_dir(fresh)
    try:
        for args in (["--run-dir", str(run_dir), "--resume", "--max-steps", "5"], [str(config), "--run-dir", str(fresh)]):
            out = inflight("run", *args)
            assert_one_named_error(out, "--run-dir", "in use by a run in progress", "run.lock")
        assert not (fresh / "config.json").exists()  # refused before it wrote anything of its own
        with pytest.raises(ConfigError, match="in use"):
            hold_run_dir(run_dir)  # a second holder in this process too
    finally:
        release_run_dir(held)
        release_run_dir(held_fresh)
    release_run_dir(hold_run_dir(run_dir))  # free again once released


def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path):
    """An in-process engine's core is forked from the run (engine.start_method = "fork"): a run
    killed outright (no release) while such a child lives must not leave its directory held by
    the child. A process holds the directory, forks a child that lives on, and exits at once."""
    import os
    import signal

    from orchestrator.run.preflight import hold_run_dir, release_run_dir

    holder = ("import os, signal, sys\n"
              "from pathlib import Path\n"
              "from orchestrator.run.preflight import hold_run_dir\n"
              "hold_run_dir(Path(sys.argv[1]))\n"
              "child = os.fork()\n"
              "if child == 0:  # lets go of the test's pipes, then lives on\n"
              "    null = os.open(os.devnull, os.O_RDWR)\n"
              "    os.dup2(null, 1)\n"
              "    os.dup2(null, 2)\n"
              "    signal.pause()\n"
              "print(child, flush=True)\n"
              "os._exit(0)  # as if killed: nothing released\n")
    out = subprocess.run([sys.executable, "-c", holder, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    child = int(out.stdout.split()[0])
    try:
        os.kill(child, 0)  # the child lives on
        release_run_dir(hold_run_dir(tmp_path))  # and the directory is free
    finally:
        os.kill(child, signal.SIGKILL)


def test_resume_with_a_config_that_differs_names_the_keys(tmp_path):
    run_dir = stored_run(tmp_path / "run", RunConfig().validate(), 1)
    config = write(tmp_path / "other.toml", "[scheduler]\ngroup_size = 4\n[trainer]\nlr = 0.1\n")
    out = inflight("run", str(config), "--run-dir", str(run_dir), "--resume")
    assert_one_named_error(out, "--resume", "scheduler.group_size", "trainer.lr")


def test_resume_of_a_finished_run_says_so_and_exits_0_starting_nothing(tmp_path):
    run_dir = stored_run(tmp_path / "run", RunConfig().validate(), 3)
    out = inflight("run", "--run-dir", str(run_dir), "--resume", "--max-steps", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "already reached step 3" in out.stdout
    assert not {"engine.starting", "trainer.command", "trainer.ready"} & set(events(run_dir))
    assert not (run_dir / "run_id").exists()  # nothing of a run was begun
    # the same, with the run's own config file given again: accepted, and finished
    config = tmp_path / "same.toml"
    config.write_text("")  # the embedded default, as stored
    again = inflight("run", str(config), "--run-dir", str(run_dir), "--resume", "--max-steps", "2")
    assert again.returncode == 0 and "already reached step 3" in again.stdout, again.stderr[-3000:]


def test_a_finished_check_never_trusts_a_checkpoint_the_log_does_not_record(tmp_path):
    from orchestrator.run.preflight import finished_steps

    config = RunConfig().validate()
    run_dir = stored_run(tmp_path / "run", config, 2)
    assert finished_steps(run_dir, config, 2) == 2
    assert finished_steps(run_dir, config, 3) is None
    (run_dir / "trainer" / "step-00000003").mkdir()
    (run_dir / "trainer" / "step-00000003" / "meta.json").write_text("{}")
    # the trainer finished step 3 but the orchestrator died before recording it: a resume
    # must run (it records step 3 from the checkpoint), not report the run finished
    assert finished_steps(run_dir, config, 3) is None


def test_a_finished_check_never_trusts_a_log_behind_the_step_journal(tmp_path):
    """A journaled step is one the trainer finished (checkpoint_every > 1, background
    checkpoints): a log that does not record it yet is not a finished run."""
    from orchestrator.run.preflight import finished_steps

    config = RunConfig().validate()
    run_dir = stored_run(tmp_path / "run", config, 2)
    assert finished_steps(run_dir, config, 2) == 2
    journal = run_dir / "trainer" / "journal"
    journal.mkdir(parents=True)
    (journal / "step-00000003.msgpack").write_bytes(b"")
    # max steps 2 reached by the log, but the trainer went on to step 3: a resume records it
    assert finished_steps(run_dir, config, 2) is None


# -- activations that keep failing -------------------------------------------------------------
def failing_stage_run(tmp_path, max_failures: int):
    """The bench's fake engine and instant trainer, with every staging refused."""
    from orchestrator.bench.orchestrator import BenchRun, fake_engine
    from orchestrator.config.run import ActivationConfig
    from orchestrator.fleet.fleet import Fleet
    from orchestrator.run.loop import RunLoop

    run = BenchRun(tmp_path, concurrency=32, rollouts=32 * 12)
    run.config = msgspec.structs.replace(run.config, activation=ActivationConfig(max_failures=max_failures))
    engine = fake_engine("fake-0")
    inner = engine.collective_rpc

    async def collective_rpc(method, args=(), kwargs=None, timeout=None):
        if method == "swap_stage":
            raise RuntimeError("injected: the staging area is full")
        return await inner(method, args, kwargs, timeout)

    engine.collective_rpc = collective_rpc
    run.fleet = Fleet([engine])
    run.loop = RunLoop(run)
    run.run_id, run.state = "fake", "running"
    return run


@pytest.mark.timeout(120)
async def test_activations_failing_n_times_stop_the_run_with_the_cause_and_healthz_says_degraded(tmp_path):
    from orchestrator.run.run import Run, RunFailed

    run = failing_stage_run(tmp_path, max_failures=3)
    seen: list[dict] = []

    async def watch_health() -> None:
        while True:
            health = Run._health(run)
            if not health["ok"] and not seen:
                seen.append(health)
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_health)
        with anyio.fail_after(90):
            await run.loop.main(run.scheduler.start())
        tg.cancel_scope.cancel()
    await run.recorder.flush()
    run.recorder.close()
    run.journal.close()
    failure = run.loop.failure
    assert failure is not None and "\n" not in failure
    assert "activation failed 3 times in a row (activation.max_failures = 3)" in failure
    assert "injected: the staging area is full" in failure
    assert run.scheduler.done_steps < run.max_steps
    # while it was failing (before the limit), /healthz said so, with the cause
    assert seen and seen[0]["degraded"].startswith("activation failing: version ")
    assert "injected: the staging area is full" in seen[0]["degraded"]
    assert cli.exit_code(RunFailed(failure)) == 2


@pytest.mark.timeout(120)
async def test_a_successful_activation_clears_the_degraded_report(tmp_path):
    run = failing_stage_run(tmp_path, max_failures=5)
    engine = run.fleet.engines["fake-0"]
    failing = engine.collective_rpc
    calls = [0]

    async def fail_once(method, args=(), kwargs=None, timeout=None):
        if method == "swap_stage":
            calls[0] += 1
            if calls[0] == 1:
                return await failing(method, args, kwargs, timeout)
        return await type(engine).collective_rpc(engine, method, args, kwargs, timeout)

    engine.collective_rpc = fail_once
    from orchestrator.run.run import Run

    degraded = []

    async def watch_health() -> None:
        while True:
            degraded.append(not Run._health(run)["ok"])
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_health)
        with anyio.fail_after(90):
            await run.loop.main(run.scheduler.start())
        tg.cancel_scope.cancel()
    await run.recorder.flush()
    run.recorder.close()
    run.journal.close()
    assert run.loop.failure is None and run.scheduler.done_steps == run.max_steps
    assert any(degraded) and not degraded[-1]


@pytest.mark.wall_clock  # the task build must reach the factory within build_timeout_s = 2
def test_a_task_factory_that_never_returns_exits_2_naming_it_within_build_timeout_s(tmp_path, checkout_rl_model):
    """A factory (or dataset scan) that blocks: the run stops at task.build_timeout_s, naming what
    builds the task, before engines start; its thread is a daemon, so the process exits."""
    write(tmp_path / "slow_task.py", "import time\n\ndef make():\n    time.sleep(3600)\n")
    model = Path(__file__).resolve().parents[2] / "models" / "tiny-rl"
    config = write(tmp_path / "run.toml", f'[engine]\nmodel = "{model}"\n[task]\nentrypoint = "slow_task:make"\n'
                                          'build_timeout_s = 2.0\n[run]\nprogress = "plain"\n')
    out = subprocess.run(INFLIGHT + ["run", str(config), "--run-dir", str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert_one_named_error(out, "building the task", "slow_task:make", "2 s")
    assert "engine.starting" not in events(tmp_path / "run")


@pytest.mark.wall_clock  # row 2 renders within row_timeout_s = 3
async def test_a_row_that_never_returns_is_a_named_timeout_and_holds_no_loop(tmp_path, tiny_model_dir):
    """An endless task (row(index), no __len__) whose row 3 blocks: prompt(3) fails at
    task.row_timeout_s naming the row, and the loop keeps running meanwhile."""
    import threading

    import anyio

    from orchestrator.config.run import TaskConfig
    from orchestrator.errors import UserCodeTimeout
    from orchestrator.tasks import make_task

    release = threading.Event()

    class Endless:
        def row(self, index):
            if index == 3:
                release.wait(60)
            return {"prompt": f"say {index}", "answer": str(index)}

    import sys
    import types

    module = types.ModuleType("endless_rows")
    module.make = lambda: Endless()
    sys.modules["endless_rows"] = module
    try:
        # 3 s: row 2 (rendered through the chat template for the first time) must come well within
        # it on a loaded machine; 0.5 s did not once, with the test starved beside engine tests.
        config = TaskConfig(entrypoint="endless_rows:make", rewards=[{"fn": "exact"}], row_timeout_s=3.0).validate()
        task = make_task(config, str(tiny_model_dir))
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            assert (await task.prompt(2)).row["answer"] == "2"
            with pytest.raises(UserCodeTimeout, match="row 3"):
                await task.prompt(3)
            tg.cancel_scope.cancel()
        assert ticks > 10  # the loop ran while the row blocked
    finally:
        release.set()
        del sys.modules["endless_rows"]
