"""Shared fixtures: one locally built tiny model per session, and real vLLM engines on it.

Engines are session-scoped (start-up costs tens of seconds on a CPU); tests that break an
engine on purpose start their own.
"""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from orchestrator.model import build_model

    out, _ = build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory) -> Path:
    """The tiny-rl preset (what `inflight run` trains by default), built once per session: every
    `inflight run` test only reads it (a run never writes into its model directory)."""
    from orchestrator.model import ensure_model

    return ensure_model(tmp_path_factory.mktemp("models") / "tiny-rl", preset="tiny-rl", seed=0)


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
async def inproc_engine(tiny_model_dir):
    from orchestrator.config import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine

    engine = InProcessEngine(EngineConfig(model=str(tiny_model_dir), kind="inproc"), "inproc-0")
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="session")
async def server_engine(tiny_model_dir, engine_log_dir):
    from orchestrator.config import EngineConfig
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
