"""`inflight model init`: a local Qwen2 model, deterministic per seed, no network."""

from __future__ import annotations

import json

import pytest

from orchestrator.commands.cli import main
from orchestrator.errors import ConfigError, ModelError
from orchestrator.model import build_model, check_model_dir

pytestmark = [pytest.mark.timeout(300), pytest.mark.light_lane]


def test_same_seed_gives_identical_weight_files_and_another_seed_different(tmp_path, capsys):
    assert main(["model", "init", str(tmp_path / "a"), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "a") in out and "parameters" in out
    assert main(["model", "init", str(tmp_path / "b"), "--seed", "3"]) == 0
    assert main(["model", "init", str(tmp_path / "c"), "--seed", "4"]) == 0
    a, b, c = ((tmp_path / d / "model.safetensors").read_bytes() for d in "abc")
    assert a == b
    assert a != c


def test_tiny_preset_has_about_half_a_million_parameters_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, n_params = build_model(tmp_path / "m", preset="tiny", seed=0)
    assert 400_000 <= n_params <= 700_000
    meta = json.loads((out / "inflight_model.json").read_text())
    assert meta == {"preset": "tiny", "seed": 0, "parameters": n_params}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == n_params
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids).startswith("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"


def test_small_preset_is_within_its_stated_size():
    from orchestrator.model import PRESETS

    spec = PRESETS["small"]
    head = spec.hidden_size // spec.num_attention_heads
    kv = spec.num_key_value_heads * head
    per_layer = (spec.hidden_size * spec.hidden_size * 2 + spec.hidden_size * kv * 2 + kv * 2
                 + spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size + 2 * spec.hidden_size)
    total = per_layer * spec.num_hidden_layers + 2 * spec.vocab_size * spec.hidden_size + spec.hidden_size
    assert 50e6 <= total <= 150e6
    assert head in (32, 64, 80, 96, 112, 128)  # head sizes vLLM's CPU attention accepts


def test_refuses_a_non_empty_directory_and_unknown_preset(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert main(["model", "init", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(ConfigError, match="preset"):
        build_model(tmp_path / "p", preset="huge")
    with pytest.raises(ConfigError, match="seed"):
        build_model(tmp_path / "s", seed=-1)


def test_check_model_dir_names_what_is_missing(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        check_model_dir(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="weight files"):
        check_model_dir(tmp_path / "empty")


def test_a_place_where_no_directory_can_be_made_is_named_at_once(tmp_path):
    import pytest

    from orchestrator.errors import ModelError
    from orchestrator.model import build_model

    with pytest.raises(ModelError, match="cannot create a directory there") as err:
        build_model("/proc/inflight-model", preset="tiny")
    assert err.value.path == "/proc/inflight-model"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="cannot create a directory there"):
        build_model(tmp_path / "file" / "model", preset="tiny")
