"""`inflight run` used as a new user would, with real engines: an attached server left at another
version by an earlier client is reset to the run's version 0 (weights and label), and one that
serves another model is refused, naming `engine.url`. (A resume of a finished run says so and
starts nothing, `--max-steps` extends it: test_lora_run's resume test, on its finished run.)"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]
SWAP_EXTENSION = "transports.swap.SwapWorkerExtension"


@pytest.mark.timeout(900)
async def test_an_attached_server_is_reset_to_version_0_and_one_of_another_model_is_refused(
        server_engine, tiny_model_dir, tmp_path):
    """The "earlier client" is the session's server (tests/conftest.py, started with the swap
    extension as every `inflight run` engine is); the test leaves it as it found it, at the
    base weights and label 0 (its last assertion)."""
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.base import SamplingSettings
    from orchestrator.engines.server import ServerEngine
    from orchestrator.errors import ConfigError
    from orchestrator.model import build_model

    other, _ = build_model(tmp_path / "other", preset="tiny", seed=1)  # same shapes, other weights
    greedy = SamplingSettings(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [5, 17, 42, 7, 99]
    server = server_engine
    assert server.config.worker_extension_cls == SWAP_EXTENSION
    base = await server.complete("base", prompt, greedy)
    assert set(base.versions) == {0}
    # An earlier run left it at its version 7: other weights, label 7.
    await server.pause("keep")
    await server.collective_rpc("swap_load_dir", (json.dumps({"path": str(other)}),))
    await server.reset_prefix_cache()
    await server.set_weight_version(7)
    await server.resume()
    left = await server.complete("left", prompt, greedy)
    assert set(left.versions) == {7} and left.token_ids != base.token_ids  # the perturbation shows

    attached = ServerEngine(EngineConfig(model=str(tiny_model_dir), kind="server", url=server.url,
                                         worker_extension_cls=SWAP_EXTENSION), "attached")
    await attached.start()
    reset = await attached.complete("reset", prompt, greedy)
    assert reset.token_ids == base.token_ids and set(reset.versions) == {0}
    await attached.shutdown()

    wrong = ServerEngine(EngineConfig(model=str(other), kind="server", url=server.url,
                                      worker_extension_cls=SWAP_EXTENSION), "wrong-model")
    with pytest.raises(ConfigError) as refused:
        await wrong.start()
    assert refused.value.field == "engine.url" and str(other) in str(refused.value)
    await wrong.shutdown()
    assert await server.healthy()  # refusing it left the server serving, untouched
    again = await server.complete("again", prompt, greedy)
    assert again.token_ids == base.token_ids and set(again.versions) == {0}


async def test_a_joining_server_that_serves_another_dtype_or_model_is_refused_naming_the_field(server_engine,
                                                                                             tmp_path):
    """What `inflight fleet add` checks before it touches a server (docs/fleet.md): the server's
    own workers report what they serve (`swap_identity`); the first field that differs from
    the run's engines is named, and the server is left as it was."""
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.server import ServerEngine
    from orchestrator.errors import ConfigError
    from orchestrator.model import build_model

    server = server_engine
    mine = await server.identity()
    assert mine["dtype"] == "float32" and mine["lora"] is False and mine["max_model_len"] > 0
    assert Path(mine["model"]) == Path(server.config.model).resolve()
    config = EngineConfig(model=server.config.model, kind="server", url=server.url,
                          worker_extension_cls=SWAP_EXTENSION)
    for field, other in (("dtype", "bfloat16"), ("tokenizer", "/elsewhere/tokenizer"), ("lora", True)):
        joiner = ServerEngine(config, "joiner", expect={**mine, field: other})
        with pytest.raises(ConfigError) as refused:
            await joiner.start()
        assert refused.value.field == field and repr(other) in str(refused.value)
        await joiner.shutdown()
    other, _ = build_model(tmp_path / "other", preset="tiny", seed=1)
    wrong = ServerEngine(msgspec.structs.replace(config, model=str(other)), "joiner", expect=mine)
    with pytest.raises(ConfigError) as refused:
        await wrong.start()
    assert refused.value.field == "model" and str(other) in str(refused.value)
    await wrong.shutdown()
    same = ServerEngine(config, "joiner", expect=mine)
    await same.start()  # the same identity: attached (and reset to version 0, as test above leaves it)
    await same.shutdown()
    assert await server.healthy()
