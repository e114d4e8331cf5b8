"""The run's configuration: the annotated default is the embedded default, every knob is
documented there, and a bad key or value exits 2 naming its dotted path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from orchestrator.config.run import RunConfig, load_config

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

EXAMPLES = Path(__file__).parents[2] / "examples"


def _fields(struct, prefix=""):
    for name in struct.__struct_fields__:
        yield prefix + name
        value = getattr(struct, name)
        if isinstance(value, msgspec.Struct):
            yield from _fields(value, prefix + name + ".")


def test_the_annotated_default_is_the_embedded_default():
    assert load_config(EXAMPLES / "default.toml") == RunConfig().validate()


def test_every_knob_is_documented_in_the_annotated_default():
    text = (EXAMPLES / "default.toml").read_text()
    missing = [f for f in _fields(RunConfig()) if f.rsplit(".", 1)[-1] not in text]
    assert not missing, missing


def test_the_embedded_default_sets_the_swap_extension_for_activation():
    (engine_id, engine), = RunConfig().validate().engine_configs()
    assert engine.worker_extension_cls == "transports.swap.SwapWorkerExtension"


def test_engines_tables_override_per_engine():
    config = load_config(EXAMPLES / "two-engines.toml")
    ids = [(e, c.seed) for e, c in config.engine_configs()]
    assert ids == [("left", 0), ("right", 7)]


@pytest.mark.parametrize(("text", "field"), [
    ("[scheduler]\nmax_off_policy_stepz = 3\n", "scheduler.max_off_policy_stepz"),
    ("[scheduler]\nmax_off_policy_steps = -1\n", "scheduler.max_off_policy_steps"),
    ("[scheduler]\nmax_off_policy_steps = \"four\"\n", "scheduler.max_off_policy_steps"),
    ("[trainer]\nloss = \"magic\"\n", "trainer.loss"),
    ("[sampling]\ntemprature = 0.5\n", "sampling.temprature"),
    ("[sampling]\ntop_p = 2.0\n", "sampling.top_p"),
    ("[http]\nport = 70000\n", "http.port"),
    ("[[engines]]\nmax_num_seqs = 0\n", "engines[0].max_num_seqs"),
    ("[run]\nmax_steps = 0\n", "run.max_steps"),
])
def test_a_bad_key_or_value_exits_2_naming_its_dotted_path(tmp_path, text, field):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    out = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "run", str(config), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"inflight: error: {field}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "config.json").exists()


def test_resume_without_a_run_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "run", "--run-dir", str(tmp_path / "none"),
                          "--resume"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--resume" in out.stderr
