"""`inflight export-model`: a run's version as a Hugging Face directory, from a run directory made
cheaply here (the trainer's own Publisher and checkpoint code on the tiny model, no engine).

Also the identity hashes the card names (`orchestrator.run.recording.policy_identity`): the chat
template where transformers saves it, tokenizers without tokenizer.json, `.bin` weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from orchestrator.commands.cli import main
from orchestrator.config.run import EngineConfig, RunConfig, TransportConfig
from orchestrator.errors import ConfigError, ModelError
from orchestrator.commands.export_model import available_versions, export_model, read_run, resolve_version

pytestmark = [pytest.mark.timeout(300), pytest.mark.light_lane]
RUN_ID = "0123abcd4567"


def _model(base: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_run(root: Path, base: Path, steps: int = 3, keep_last: int = 2, keep_checkpoints: int = 3,
             log: bool = True) -> dict[int, dict[str, torch.Tensor]]:
    """A run directory as `inflight run` leaves it: config.json, run_id, a replay log with its
    run_meta record, published versions (the Publisher, keep_last of them) and checkpoints. The
    weights move by a seeded step each version; returns every version's state dict."""
    from orchestrator.run.recording import policy_identity
    from orchestrator.trainer import checkpoint
    from orchestrator.trainer.publish import Publisher
    from replay.log import ReplayLog
    from replay.records import RunMetaRecord

    root.mkdir(parents=True)
    config = RunConfig(engine=EngineConfig(model=str(base)), transport=TransportConfig(keep_last=keep_last))
    (root / "config.json").write_bytes(msgspec.json.encode(config))
    (root / "run_id").write_text(RUN_ID + "\n")
    if log:
        with ReplayLog.open(root) as replay:
            replay.append(RunMetaRecord(run_id=RUN_ID, created_at=time.time(),
                                        identity=policy_identity(base, "float32", "raw_logprobs"),
                                        config={**msgspec.to_builtins(config), "model_dir": str(base.resolve())}))
    model = _model(base)
    optimizer = torch.optim.Adam(model.parameters())
    publisher = Publisher(model, root, config.transport, version=0)
    states = {0: _state(model)}
    gen = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        consumption = checkpoint.Consumption([], [], [], [], 0.25, 0.5, {})
        meta = checkpoint.CheckpointMeta(step=step, version=step, consumption=consumption, created_unix=time.time())
        checkpoint.save(root, model, optimizer, meta, keep=keep_checkpoints)  # first, as the trainer does
        publisher.publish(step)
        states[step] = _state(model)
    publisher.close()  # waits for the pruning of versions beyond keep_last
    return states


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("export") / "run"
    return root, make_run(root, tiny_model_dir)


def assert_exported(out: Path, want: dict[str, torch.Tensor]) -> None:
    """The directory loads in transformers and holds exactly `want` (a tied head once)."""
    model = _model(out)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_versions_come_from_published_dirs_then_checkpoints_and_latest_is_the_newest(run, tiny_model_dir):
    root, _ = run
    info = read_run(root)
    assert info.run_id == RUN_ID and info.base_dir == tiny_model_dir.resolve()
    sources = available_versions(info)
    # keep_last=2 pruned the published v1; its checkpoint (keep 3) still holds it.
    assert {v: s.kind for v, s in sources.items()} == {0: "base", 1: "checkpoint", 2: "published", 3: "published"}
    assert sources[1].path == root / "trainer" / "step-00000001" / "model.safetensors"
    assert resolve_version(info, "latest").version == 3
    assert resolve_version(info, 2).version == resolve_version(info, "v2").version == 2
    with pytest.raises(ConfigError, match=r"version 7 is not retained .*available: 0, 1, 2, 3") as info_error:
        resolve_version(info, 7)
    assert info_error.value.field == "--version"
    with pytest.raises(ConfigError, match="--version"):
        resolve_version(info, "newest")


@pytest.mark.parametrize("version", [0, 1, 3])
def test_each_source_exports_the_versions_exact_weights(run, tiny_model_dir, tmp_path, version):
    root, states = run
    result = export_model(root, version, out_dir=tmp_path / "out")
    assert (result.path, result.version) == (tmp_path / "out", version)
    assert result.source == {0: "base", 1: "checkpoint", 3: "published"}[version]
    assert_exported(result.path, states[version])
    # The base's tokenizer, chat template and generation config, byte for byte; no builder marker.
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (result.path / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert not (result.path / "inflight_model.json").exists()
    assert json.loads((result.path / "config.json").read_text())["model_type"] == "qwen2"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(result.path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>")


def test_the_card_names_run_version_source_base_and_identity(run, tiny_model_dir, tmp_path):
    from orchestrator.run.recording import policy_identity, weights_digest

    root, _ = run
    out = tmp_path / "out"
    main(["export-model", str(root), str(out)])  # --version latest
    card = (out / "README.md").read_text()
    identity = policy_identity(tiny_model_dir, "float32", "raw_logprobs")
    assert f"# version 3 of run {RUN_ID}" in card
    assert "| policy version | 3 (after trainer step 3) |" in card
    assert f"`{root.resolve() / 'weights' / 'v00000003'}`" in card
    assert f"| base model | `{tiny_model_dir.resolve()}` |" in card
    assert f"`{identity.base_checkpoint}` (recorded by the run" in card
    assert identity.chat_template_hash and identity.chat_template_hash in card
    assert f"sha256 `{weights_digest(out)[:16]}`" in card
    # Without a replay log the base identity is computed at export, and said to be.
    bare = tmp_path / "bare"
    make_run(bare, tiny_model_dir, steps=1, log=False)
    export_model(bare, 0, out_dir=tmp_path / "out0")
    card0 = (tmp_path / "out0" / "README.md").read_text()
    assert f"`{identity.base_checkpoint}` (computed at export" in card0
    assert "| policy version | 0 (the base model) |" in card0


def test_errors_name_the_argument_and_exit_2_without_touching_anything(run, tmp_path, capsys):
    root, _ = run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("keep me")
    (tmp_path / "notarun").mkdir()
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o1")], "RUN_DIR: ", "is not a directory"),
        ([str(tmp_path / "notarun"), str(tmp_path / "o2")], "RUN_DIR: ", "not a run directory"),
        ([str(root), str(tmp_path / "full")], "OUT_DIR: ", "exists and is not an empty directory"),
        ([str(root), str(tmp_path / "o3"), "--version", "9"], "--version: ", "available: 0, 1, 2, 3"),
    ]
    for argv, field, words in cases:
        assert main(["export-model", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and field in err and words in err, err
    assert (tmp_path / "full" / "keep.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "notarun"]  # nothing written


def test_an_empty_out_dir_is_filled_and_a_failed_export_leaves_nothing(run, tiny_model_dir, tmp_path):
    root, states = run
    (tmp_path / "empty").mkdir()
    export_model(root, 2, out_dir=tmp_path / "empty")
    assert_exported(tmp_path / "empty", states[2])
    # A published version whose tensor does not fit the base (another model's): refused by
    # name, after part of the export was written; neither OUT_DIR nor a temporary remains.
    broken = tmp_path / "broken"
    make_run(broken, tiny_model_dir, steps=1)
    bucket = next((broken / "weights" / "v00000001").glob("*.safetensors"))
    tensors = load_file(bucket)
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, bucket)
    with pytest.raises(ModelError, match=r"'model.norm.weight' has shape \(7,\)"):
        export_model(broken, 1, out_dir=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "empty"]
    tensors["model.norm.weight"] = torch.ones(128)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, bucket)
    with pytest.raises(ModelError, match="lacks 1 of the model's tensors .*up_proj"):
        export_model(broken, 1, out_dir=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "empty"]


def test_a_base_model_changed_since_the_run_is_refused_naming_what_changed(tmp_path, tiny_model_dir):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    root = tmp_path / "run"
    states = make_run(root, base, steps=1)
    weights = load_file(base / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="its weights changed since the run"):
        export_model(root, 0, out_dir=tmp_path / "out0")
    # A trained version replaces every weight: only the tokenizer and template must be the run's.
    assert_exported(export_model(root, 1, out_dir=tmp_path / "out1").path, states[1])
    (base / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(ModelError, match="its chat template changed since the run"):
        export_model(root, 1, out_dir=tmp_path / "out2")
    assert not (tmp_path / "out0").exists() and not (tmp_path / "out2").exists()


def test_a_tied_model_without_pad_token_exports_from_a_checkpoint_that_stores_the_head_once(tmp_path, tiny_model_dir):
    """tie_word_embeddings: the checkpoint (safetensors' save_model) stores the tied tensor under
    the head's name only, the published version under both. Both export the same weights in
    the checkpoint layout transformers writes (the embedding's name), the head tied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    config = Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    assert config.pad_token_id is None
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base)
    root = tmp_path / "run"
    states = make_run(root, base, steps=2, keep_last=1)
    stored = load_file(root / "trainer" / "step-00000001" / "model.safetensors")
    assert "lm_head.weight" in stored and "model.embed_tokens.weight" not in stored
    for version, kind in ((1, "checkpoint"), (2, "published")):
        result = export_model(root, version, out_dir=tmp_path / f"out{version}")
        assert result.source == kind
        assert_exported(result.path, states[version])
        written = load_file(result.path / "model.safetensors")
        assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written
        exported = _model(result.path)
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()


def test_a_version_in_engine_layout_is_mapped_back_through_the_refit_map(tmp_path, tiny_model_dir):
    """Qwen3-MoE: transformers holds each layer's experts fused, the engine (and the checkpoint)
    names them one by one. A version published in the engine layout is written back through the
    refit map's views."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    from transports.refit.families import map_for_config
    from transports.refit.views import apply_views

    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    base = tmp_path / "base"
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base)
    root = tmp_path / "run"
    make_run(root, base, steps=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    want = _state(model)
    meta = {k: (tuple(v.shape), v.dtype) for k, v in want.items()}
    engine = {name: apply_views(want[src], views).contiguous()
              for name, src, views in map_for_config(model.config).refit(meta)}
    assert any(".experts.0.gate_proj." in n for n in engine) and not any(n in want for n in engine if ".experts." in n)
    version = root / "weights" / "v00000001"
    version.mkdir(parents=True)
    save_file(engine, version / "bucket-00000.safetensors")
    (version / "COMPLETE").touch()
    result = export_model(root, "latest", out_dir=tmp_path / "out")
    assert (result.version, result.source) == (1, "published")
    assert_exported(result.path, want)


def test_identity_hashes_the_template_transformers_loads_and_any_tokenizer_and_weights(tmp_path, tiny_model_dir):
    import hashlib
    import shutil

    from orchestrator.run.recording import chat_template_of, policy_identity, tokenizer_digest, weights_digest

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    jinja = (model / "chat_template.jinja").read_text()
    assert chat_template_of(model) == jinja  # where transformers >= 4.43 saves it
    assert policy_identity(model, "float32", "raw_logprobs").chat_template_hash == \
        hashlib.sha256(jinja.encode()).hexdigest()[:16]
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    named = [{"name": "default", "template": jinja}, {"name": "tool_use", "template": "{{ messages }}"}]
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert "tool_use" in chat_template_of(model)  # a list of named templates hashes, not crashes
    # A sentencepiece-style tokenizer (no tokenizer.json) is still hashed.
    before = tokenizer_digest(model)
    (model / "tokenizer.json").rename(model / "tokenizer.model")
    assert tokenizer_digest(model) not in ("", before)
    # .bin weights (safe_serialization=False) are hashed when there are no safetensors.
    streamed = weights_digest(model)
    whole = hashlib.sha256(b"model.safetensors" + (model / "model.safetensors").read_bytes()).hexdigest()
    assert streamed == whole
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    assert weights_digest(model) not in (streamed, hashlib.sha256().hexdigest())


def test_a_tied_checkpoint_written_by_one_process_resumes_under_fsdp(tmp_path):
    """`save` (one process) stores a tied embedding under the head's name, `save_full` (FSDP2)
    under the input embedding's: `load_full` takes either, so a checkpoint of a tied model
    resumes at any world size (here: one process's checkpoint in a gloo group of one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from orchestrator.trainer import checkpoint

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    plain, sharded = Qwen2ForCausalLM(cfg), Qwen2ForCausalLM(cfg)  # different weights
    optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
    plain(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    meta = checkpoint.CheckpointMeta(step=1, version=1, created_unix=0.0,
                                     consumption=checkpoint.Consumption([], [], [], [], 0.0, 0.0, {}))
    checkpoint.save(tmp_path, plain, optimizer, meta, keep=1)
    stored = load_file(tmp_path / "trainer" / "step-00000001" / "model.safetensors")
    assert "lm_head.weight" in stored and "model.embed_tokens.weight" not in stored
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(sharded.model.layers[0], mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        sharded_optimizer = torch.optim.Adam(sharded.parameters(), lr=1e-3)
        assert checkpoint.load_full(tmp_path, 1, sharded, sharded_optimizer, rank=0) == meta
        weights = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(weights[k], v) for k, v in plain.state_dict().items())


def test_eval_of_a_version_the_run_does_not_have_exits_2_naming_those_it_has(run, capsys):
    """Every command that takes a version (export-model above, replay --target in
    test_replay_analysis.py, eval here) names the versions the run holds, before any engine starts."""
    root, _ = run
    assert main(["eval", str(root), "--version", "9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--version" in err and "available: 0, 1, 2, 3" in err, err


def test_a_run_with_its_own_chat_template_exports_that_template(tmp_path, tiny_model_dir):
    """`task.chat_template` as a path: the run's identity hashes that template (what rendered the
    prompts), RUN_DIR keeps a copy, and the export carries it (not the base model's), so the
    exported model renders as the run did; a copy that no longer matches the recorded hash is
    refused naming the chat template."""
    from transformers import AutoTokenizer

    from orchestrator.run.recording import RUN_TEMPLATE, keep_run_template, policy_identity

    own = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    base_hash = policy_identity(tiny_model_dir, "", "").chat_template_hash
    assert policy_identity(tiny_model_dir, "", "", chat_template=own).chat_template_hash not in ("", base_hash)
    root = tmp_path / "run"
    make_run(root, tiny_model_dir, steps=1, log=False)
    keep_run_template(root, own)
    from replay.log import ReplayLog
    from replay.records import RunMetaRecord

    with ReplayLog.open(root) as replay:
        replay.append(RunMetaRecord(run_id=RUN_ID, created_at=time.time(),
                                    identity=policy_identity(tiny_model_dir, "float32", "raw_logprobs",
                                                             chat_template=own),
                                    config={"model_dir": str(tiny_model_dir.resolve())}))
    export_model(root, 1, out_dir=tmp_path / "out")
    assert (tmp_path / "out" / RUN_TEMPLATE).read_text() == own
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == own
    (root / RUN_TEMPLATE).write_text(own + " ")
    with pytest.raises(ModelError, match="chat template changed"):
        export_model(root, 1, out_dir=tmp_path / "out2")
