"""Shared fixtures: one locally built tiny model per session, and real vLLM engines on it.

Engines are session-scoped (start-up costs tens of seconds on a CPU); tests that break an
engine on purpose start their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# vLLM's CPU worker pins itself to core 0 and sizes its KV cache from this (GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from orchestrator.model import build_model

    out, _ = build_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)
    return out


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

    engine = ServerEngine(EngineConfig(model=str(tiny_model_dir), kind="server"), "server-0",
                          log_dir=engine_log_dir)
    await engine.start()
    yield engine
    await engine.shutdown()
