"""Configuration: TOML in, typed Structs out; a bad field is an error that names it."""

from __future__ import annotations

import pytest

from orchestrator.config.run import ActivationConfig, load_config
from orchestrator.errors import ConfigError
from orchestrator.fleet.fleet import Fleet

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)


def write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_full_config_loads_into_typed_structs(tmp_path):
    config = load_config(write(tmp_path, """
engines = 2
[engine]
model = "models/tiny"
kind = "server"
max_num_seqs = 8
[activation]
strategy = "double_buffer"
kv_policy = "keep"
stage_s = 5.0
"""))
    assert config.engines == 2
    assert config.engine.kind == "server" and config.engine.max_num_seqs == 8
    assert config.activation.strategy == "double_buffer" and config.activation.kv_policy == "keep"
    assert config.activation.timeouts().stage_s == 5.0


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[activation]\nkv_policy = \"sometimes\"\n", "activation.kv_policy"),
        ("[activation]\nstrategy = \"pause_free\"\nkv_policy = \"recompute\"\n", "activation.kv_policy"),
        ("[activation]\nstage_s = 0\n", "activation.stage_s"),
        ("[engine]\nmax_num_seqs = \"many\"\n", "engine.max_num_seqs"),
        ("[engine]\nmax_num_seqs = 0\n", "engine.max_num_seqs"),
        ("[engine]\nunknown_knob = 1\n", "engine"),
        ("engines = 0\n", "engines"),
        ("[engine]\ncpu_bind = \"1\"\n", "engine.cpu_bind"),  # an in-process engine's
        ("[engine]\nkind = \"server\"\ncpu_bind = \"core one\"\n", "engine.cpu_bind"),
        ("[engine]\nkind = \"server\"\nurl = \"http://127.0.0.1:9\"\ncpu_bind = \"1\"\n", "engine.cpu_bind"),
    ],
)
def test_a_bad_field_is_named(tmp_path, text, field):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.field.startswith(field), (info.value.field, str(info.value))


def test_missing_or_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[engine\n"))


class NamedOnly:
    """The fleet only reads engine ids at construction; no engine is started here."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id


def test_the_fleet_takes_its_policy_from_the_config():
    fleet = Fleet.from_config([NamedOnly("e0"), NamedOnly("e1")], ActivationConfig(strategy="pause_free", kv_policy="keep", swap_s=7.0))
    assert fleet.strategy == "pause_free"
    assert fleet.coordinator.kv_policy == "keep"
    assert fleet.coordinator.timeouts.swap_s == 7.0


def test_every_example_config_loads():
    from pathlib import Path

    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        load_config(path)


def test_a_server_engines_cpu_bind_is_the_cores_its_worker_binds(monkeypatch):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.server import server_env

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(EngineConfig(kind="server"))  # vLLM's own choice
    for cores in ("1", "0-3", "0,2-3"):
        config = EngineConfig(kind="server", cpu_bind=cores).validate()
        assert server_env(config)["VLLM_CPU_OMP_THREADS_BIND"] == cores
