"""The tiny-rl preset (tiny's shapes, a narrow init) and ensure_model: it refuses to reuse a
directory built here with another preset or seed, and uses a directory made elsewhere as it is."""

from __future__ import annotations

import json

import torch

import pytest

from orchestrator.errors import ModelError
from orchestrator.model import PRESETS, build_model, ensure_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.light_lane]


def test_tiny_rl_has_tinys_shapes_and_a_narrower_init():
    tiny, rl = PRESETS["tiny"], PRESETS["tiny-rl"]
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")
    assert [getattr(rl, f) for f in shape] == [getattr(tiny, f) for f in shape] == [1024, 128, 256, 2, 4, 2]
    assert rl.init_std == 0.02 and tiny.init_std == 0.08 and PRESETS["small"].init_std == 0.08
    small, small_rl = PRESETS["small"], PRESETS["small-rl"]
    assert [getattr(small_rl, f) for f in shape] == [getattr(small, f) for f in shape]
    assert small_rl.init_std == 0.02


def test_tiny_rl_weights_have_std_002_and_a_near_uniform_first_token(tmp_path):
    import torch
    from safetensors.torch import load_file

    out, n_params = build_model(tmp_path / "rl", preset="tiny-rl", seed=0)
    meta = json.loads((out / "inflight_model.json").read_text())
    assert meta == {"preset": "tiny-rl", "seed": 0, "parameters": n_params}
    weights = load_file(out / "model.safetensors")
    matrices = torch.cat([w.flatten() for w in weights.values() if w.dim() >= 2])
    assert float(matrices.std()) == pytest.approx(0.02, rel=0.05)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 87, 481]])).logits[0, -1]
    probs = torch.softmax(logits, -1)
    assert float(probs.max()) < 5.0 / 1024  # close to uniform: RL moves it quickly


def test_ensure_model_reuses_only_a_directory_built_with_the_same_preset_and_seed(tmp_path):
    path = tmp_path / "m"
    assert ensure_model(path, preset="tiny-rl", seed=1) == path
    before = (path / "model.safetensors").read_bytes()
    assert ensure_model(path, preset="tiny-rl", seed=1) == path  # reused, not rebuilt
    assert (path / "model.safetensors").read_bytes() == before
    with pytest.raises(ModelError, match=str(path)) as info:
        ensure_model(path, preset="tiny", seed=1)
    assert "tiny-rl" in str(info.value)
    with pytest.raises(ModelError, match="seed 1"):
        ensure_model(path, preset="tiny-rl", seed=2)
    (path / "inflight_model.json").write_text("[not json")
    with pytest.raises(ModelError, match="unreadable inflight_model.json"):
        ensure_model(path, preset="tiny-rl", seed=1)


def test_ensure_model_uses_a_directory_made_elsewhere_as_it_is(tmp_path):
    """No inflight_model.json: a Hugging Face directory from anywhere (here: the built model's
    files without the marker) is used as it is, whatever the preset and seed asked for."""
    path = tmp_path / "m"
    build_model(path, preset="tiny", seed=3)
    (path / "inflight_model.json").unlink()
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    assert ensure_model(path, preset="tiny-rl", seed=0) == path
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before  # neither rebuilt nor marked
    # Still checked: a config.json without weights is named, not rebuilt over.
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no weight files"):
        ensure_model(path, preset="tiny-rl", seed=0)
    # A directory that holds no model (no config.json) and is not empty is refused, not overwritten.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "x.txt").write_text("keep me")
    with pytest.raises(ModelError, match="not empty"):
        ensure_model(other, preset="tiny", seed=0)
    assert (other / "x.txt").read_text() == "keep me"


def test_model_init_offers_every_preset(tmp_path, capsys):
    from orchestrator.commands.cli import main

    with pytest.raises(SystemExit):
        main(["model", "init", "--help"])
    assert "tiny-rl" in capsys.readouterr().out


def test_tiny_lora_is_tiny_rl_with_a_four_times_wider_head(tmp_path):
    from safetensors.torch import load_file

    from orchestrator.model import build_model

    rl, _ = build_model(tmp_path / "rl", preset="tiny-rl", seed=0)
    lora, _ = build_model(tmp_path / "lora", preset="tiny-lora", seed=0)
    a, b = load_file(str(rl / "model.safetensors")), load_file(str(lora / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        if name == "lm_head.weight":
            assert torch.allclose(b[name], 4 * a[name], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[name], b[name]), name


def test_two_builders_of_one_path_at_once_both_get_the_model_the_second_one_refused_to_overwrite(tmp_path, monkeypatch):
    """Two processes ensure the same model at once (two runs or two test sessions on a fresh
    checkout): the one whose rename comes second finds the place taken and uses what the first
    wrote, built as asked; one that finds another preset there still refuses it."""
    import orchestrator.model as model

    path = tmp_path / "m"
    real = model._make_readable
    first_wrote: list[bytes] = []

    def the_other_builder_finishes_first(directory):
        real(directory)
        if not first_wrote:  # between this build's last file and its rename
            first_wrote.append(b"")
            build_model(path, preset="tiny", seed=4)
            first_wrote[0] = (path / "model.safetensors").read_bytes()

    monkeypatch.setattr(model, "_make_readable", the_other_builder_finishes_first)
    assert ensure_model(path, preset="tiny", seed=4) == path
    assert (path / "model.safetensors").read_bytes() == first_wrote[0]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # the loser's scratch directory is gone

    other = tmp_path / "other"
    first_wrote.clear()

    def another_preset_lands_first(directory):
        real(directory)
        if not first_wrote:
            first_wrote.append(b"")
            build_model(other, preset="tiny-rl", seed=4)

    monkeypatch.setattr(model, "_make_readable", another_preset_lands_first)
    with pytest.raises(ModelError, match="tiny-rl"):
        ensure_model(other, preset="tiny", seed=4)
