"""Shared fixtures: one locally built tiny model per session, and real vLLM engines on it.

Engines are session-scoped (start-up costs tens of seconds on a CPU); tests that break an
engine on purpose start their own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run: CI is not the place where a new
# counterexample turns up at random (search with HYPOTHESIS_PROFILE=explore).
settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# vLLM's CPU worker pins itself to core 0 and sizes its KV cache from this (GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The suite's order: the unit tests first, the multi-host scenario last. `make test` builds verifiers
# 0.4's venv beside the suite (the Makefile), and on a fresh clone that build (a pip install, a
# minute or two of both cores) ran beside the first tests: the cluster scenario, five hosts' engines
# on two cores, took 479 s there against ~300 s alone (CI, 2026-12-05). Within a directory the order
# is pytest's.
_ORDER = ("unit", "integration", "reliability", "cluster")

# The lanes (`--lane`, run side by side by `make test` through tests/lanes.py; plain `pytest`
# runs one session with both, in the order above). The light lane runs at a lower priority beside
# the main one: an engine's run leaves one of two cores idle about half the time (measured: core 0
# 50% busy, core 1 87%, over three engine modules), and the light lane's tests use it. But a light
# test can get as little as a tenth of a core while the main lane keeps both busy, so the light
# lane holds only what passes at any pace: modules marked `light_lane`, each read for bounds first
# (no wall-clock bound on real work but pytest-timeout's minutes; two lane runs of 2026-12-06 each
# failed a different test that had one, when every test that started no engine was light). All
# else is main: an unmarked module, a test marked `wall_clock` (a bound of seconds inside a
# light_lane module), one that asks for an engine the session shares (the main session holds those
# engines), and the multi-host tests.
ENGINE_FIXTURES = frozenset({"inproc_engine", "server_engine", "run_server", "interrupted_run", "crash_resume_run"})


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "wall_clock: needs seconds of CPU within a short wall-clock bound: "
                                       "runs in the main lane, never starved beside it")
    config.addinivalue_line("markers", "light_lane: passes at any pace (no wall-clock bound on real work but "
                                       "pytest-timeout's): runs in the light lane, beside the main one")


def pytest_addoption(parser) -> None:
    parser.addoption("--lane", choices=("all", "main", "light"), default="all",
                     help="light: the modules marked light_lane (but their wall_clock tests and those using a "
                          "shared engine); main: the rest; all (plain pytest): both, one after another")


def in_main_lane(item, top: str) -> bool:
    if top == "cluster" or item.get_closest_marker("wall_clock") is not None:
        return True
    if not ENGINE_FIXTURES.isdisjoint(item.fixturenames):
        return True
    return item.get_closest_marker("light_lane") is None


def pytest_collection_modifyitems(session, config, items) -> None:
    tests = Path(__file__).resolve().parent

    def top_of(item) -> str:
        try:
            return Path(str(item.fspath)).resolve().relative_to(tests).parts[0]
        except ValueError:
            return ""

    def rank(item) -> int:
        top = top_of(item)
        if not top:
            return len(_ORDER)
        return _ORDER.index(top) if top in _ORDER else len(_ORDER) - 1

    items.sort(key=rank)
    lane = config.getoption("lane")
    if lane != "all":
        keep, dropped = [], []
        for item in items:
            (keep if in_main_lane(item, top_of(item)) == (lane == "main") else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from orchestrator.model import build_model

    out, _ = build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def verifiers04_python() -> Path:
    """The verifiers 0.4 venv's python, built by the Makefile's recipe when missing (cached after:
    `make test` builds it first; a minute or more from the package index)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / ".venv-verifiers" / ".installed-uv").exists():  # the Makefile's stamp (uv and its cache too)
        subprocess.run(["make", "-s", "verifiers-venv"], cwd=root, check=True, timeout=1500)
    return root / ".venv-verifiers" / "bin" / "python"


@pytest.fixture(scope="session")
def checkout_rl_model() -> Path:
    """The checkout's own models/tiny-rl, as `make run` builds it, for the tests that name the
    default's path: built here when missing (a fresh clone's suite has none until then)."""
    from orchestrator.model import ensure_model

    return ensure_model(Path(__file__).resolve().parents[1] / "models" / "tiny-rl", preset="tiny-rl")


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory) -> Path:
    """The tiny-rl preset (what `inflight run` trains by default), built once per session: every
    `inflight run` test only reads it (a run never writes into its model directory)."""
    from orchestrator.model import ensure_model

    return ensure_model(tmp_path_factory.mktemp("models") / "tiny-rl", preset="tiny-rl", seed=0)


class InterruptedRun(NamedTuple):
    """What `interrupted_run` left."""

    run_dir: Path
    code: int  # its exit code after the Ctrl-C
    output: str  # its stdout and stderr
    left: list  # (pid, command line) of its processes alive 10 s after it exited


@pytest.fixture(scope="session")
def interrupted_run(tmp_path_factory, rl_model) -> InterruptedRun:
    """One `inflight run` stopped by a terminal's Ctrl-C (SIGINT to its whole process group) once
    it consumed 5 steps, shared by test_replay_analysis_run (its scheduler is set so that rollouts
    cross activations: one step of staleness at most, few in flight, longer completions: the log
    has multi-version spans) and test_no_orphans (the stop was graceful and left no process; its
    processes are told apart by test_no_orphans' environment marker)."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from replay.log import read_records
    from replay.records import ConsumptionRecord
    from tests.reliability.test_no_orphans import gone_within, kill_marked, marked_env

    root = tmp_path_factory.mktemp("interrupted-run")
    config = root / "config.toml"
    config.write_text(f"""
[engine]
model = "{rl_model}"
[run]
progress = "none"
tensorboard = false
shutdown_grace_s = 10.0
[http]
enabled = false
[scheduler]
group_size = 4
batch_groups = 4
max_off_policy_steps = 1
max_inflight = 16
[sampling]
max_tokens = 64
[transport]
keep_last = 32
""")
    run_dir, log, mark = root / "run", root / "run.log", uuid.uuid4().hex

    def steps_done() -> int:
        try:
            return sum(1 for r in read_records(run_dir) if isinstance(r, ConsumptionRecord))
        except Exception:  # noqa: BLE001 - the log is being written
            return 0

    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.commands.cli", "run", str(config), "--run-dir", str(run_dir),
                             "--max-steps", "200"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=marked_env(mark), start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while steps_done() < 5:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no step 5 (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        code = proc.wait(300)
        left = gone_within(mark, 10)
    finally:
        kill_marked(mark)
    return InterruptedRun(run_dir, code, log.read_text(), left)


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
async def inproc_engine(tiny_model_dir):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine

    engine = InProcessEngine(EngineConfig(model=str(tiny_model_dir), kind="inproc"), "inproc-0")
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="session")
async def server_engine(tiny_model_dir, engine_log_dir):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.server import ServerEngine

    # A control call can wait behind a long token stream on the shared core (one abort took
    # over 60 s in CI): the tests check what the calls do, not how fast, so they wait longer.
    # With the swap extension, as every `inflight run` engine has (test_run_misuse loads other
    # weights into it and resets it).
    engine = ServerEngine(EngineConfig(model=str(tiny_model_dir), kind="server", control_timeout_s=300.0,
                                       worker_extension_cls="transports.swap.SwapWorkerExtension"),
                          "server-0", log_dir=engine_log_dir)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="session")
def run_server(rl_model, engine_log_dir) -> str:
    """The URL of one vLLM server of `rl_model` that `inflight run` tests attach to
    (`tests.helpers.attach_to(url)`). Each run resets it to version 0
    at its start, as it does any attached server (`ServerEngine.reset_to_base`), so a test that
    attaches saves an engine start (about 15 s) and proves nothing less: what a run's engine
    does is the same whoever started it. Only short runs attach: its tokens stream over HTTP, so a
    long run pays per token (the default run's 60 steps: 101 s on it, 60 s on its own in-process
    engine). Runs whose engine settings differ start their own."""
    import anyio

    from orchestrator.config.run import SWAP_EXTENSION, EngineConfig
    from orchestrator.engines.server import ServerEngine

    engine = ServerEngine(EngineConfig(model=str(rl_model), kind="server", worker_extension_cls=SWAP_EXTENSION),
                          "run-server", log_dir=engine_log_dir)

    async def start() -> None:
        await engine.start()
        client, engine._client = engine._client, None  # the runs talk to it; this event loop ends here
        await client.aclose()

    anyio.run(start)
    yield engine.url
    engine._terminate_process_group()


@pytest.fixture(scope="session")
def tool_agent_dir(rl_model, tmp_path_factory) -> Path:
    """tiny-rl tuned to call its `add` tool in the Agents SDK's and LangChain's conversations
    (`tests.framework_agents.tool_agent_model`), built once per session for the engine test and
    the run test."""
    from tests.framework_agents import tool_agent_model

    return tool_agent_model(rl_model, tmp_path_factory.mktemp("tool-agent") / "model")


@pytest.fixture(scope="module", autouse=True)
def _no_vllm_state_leaks_between_modules():
    """An in-process vLLM engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor) leaves
    the pytest process's model-parallel groups initialized after it is gone, and a module that
    sets that variable leaves it set. The next module that builds a vLLM model in this process
    (another architecture: an MoE model needs an expert-parallel group a dense one never made)
    would then find stale groups. Each module starts from what the session had."""
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    yield
    if saved is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
    import sys

    ps = sys.modules.get("vllm.distributed.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
