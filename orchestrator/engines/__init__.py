"""Inference engines behind one interface (`base.Engine`): in-process AsyncLLM or a server."""

from __future__ import annotations

from orchestrator.engines.base import Completion, Engine, SamplingSettings, TokenChunk


def make_engine(config, engine_id: str = "engine-0", log_dir=None) -> Engine:
    """Build (not start) the engine that `config.kind` names."""
    if config.kind == "inproc":
        from orchestrator.engines.inproc import InProcessEngine

        return InProcessEngine(config, engine_id)
    from orchestrator.engines.server import ServerEngine

    return ServerEngine(config, engine_id, log_dir=log_dir)


__all__ = ["Completion", "Engine", "SamplingSettings", "TokenChunk", "make_engine"]
