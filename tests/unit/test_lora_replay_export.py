"""LoRA runs in `inflight replay` and `inflight export-model`: a version v >= 1 is a PEFT adapter
directory (what `PeftModel.save_pretrained` writes, plus COMPLETE) merged into the base.

The run is built here without an engine or trainer: two real PEFT adapters (rank 8 on q_proj and
v_proj, lora_B drawn at random so they change the outputs) on the tiny model, published as
versions 1 and 2, rollouts sampled with PEFT itself (base + adapter, unmerged) and recorded in a
real replay log. The reference for every merge is PEFT's own forward.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from orchestrator.commands.cli import main
from orchestrator.config.run import EngineConfig, LoraConfig, RunConfig, TrainerConfig
from orchestrator.errors import ConfigError, ModelError
from orchestrator.commands.export_model import export_model
from replay.errors import AdapterError
from replay.log import FsyncPolicy, ReplayLog, read_records
from replay.records import ActivationRecord, EngineActivation, RolloutRecord, RunMetaRecord, SamplingSettings, Timings
from tests.unit.sample_helpers import sample_tokens

pytestmark = [pytest.mark.timeout(600), pytest.mark.light_lane]
RUN_ID = "10ra0000beef"
RANK, ALPHA, TARGETS = 8, 16, ["q_proj", "v_proj"]
COMPLETION = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model on a shared CPU: one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _base(base: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def _adapter(base: Path, seed: int):
    """A PEFT LoRA model on a fresh copy of the base; lora_B random (PEFT starts it at zero)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = get_peft_model(_base(base), PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                      task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.2, generator=gen)
    return model.eval()


def _publish(run: Path, version: int, model) -> Path:
    out = run / "weights" / f"v{version:08d}"
    model.save_pretrained(out)
    (out / "COMPLETE").write_text("")
    return out


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()




def _run_config(base: Path) -> RunConfig:
    lora = LoraConfig(rank=RANK, alpha=float(ALPHA), target_modules=TARGETS)
    return RunConfig(engine=EngineConfig(model=str(base)), trainer=TrainerConfig(lora=lora))


def _write_rollouts(run: Path, base: Path, models: dict, gen: torch.Generator) -> None:
    """run_meta, activations of v1 and v2, and rollouts sampled by each version (and two that
    span v1 -> v2, recomputed under v2 from the switch on)."""
    from orchestrator.run.recording import policy_identity

    identity = policy_identity(base, "float32", "raw_logprobs")
    config = _run_config(base)
    rollouts = []
    for version in (0, 1, 2, 1, 2):
        prompt = torch.randint(3, 1000, (6,), generator=gen).tolist()
        tokens, lps = sample_tokens(models[version], prompt, COMPLETION, gen)
        rollouts.append((prompt, tokens, lps, [version] * COMPLETION))
    for _ in range(2):
        prompt = torch.randint(3, 1000, (6,), generator=gen).tolist()
        head, head_lp = sample_tokens(models[1], prompt, 5, gen)
        tail, tail_lp = sample_tokens(models[2], prompt + head, COMPLETION - 5, gen)
        rollouts.append((prompt, head + tail, head_lp + tail_lp, [1] * 5 + [2] * (COMPLETION - 5)))
    with ReplayLog.open(run, fsync=FsyncPolicy.every(1000)) as log:
        log.append(RunMetaRecord(run_id=RUN_ID, created_at=time.time(), identity=identity,
                                 config={**msgspec.to_builtins(config), "model_dir": str(base.resolve())}))
        for v in (1, 2):
            log.append(ActivationRecord(version=v, outcome="activated", kv_policy="recompute",
                                        engines=[EngineActivation("e0", 0.1, 0.01)]))
        for rid, (prompt, tokens, lps, versions) in enumerate(rollouts):
            log.append(RolloutRecord.from_lists(
                rollout_id=rid, group_id=rid, prompt_id=str(rid), engine_id="e0", prompt_token_ids=prompt,
                completion_token_ids=tokens, completion_logprobs=lps, dispatched_version=versions[0],
                token_versions=versions, identity=identity, sampling=SamplingSettings(temperature=1.0),
                timings=Timings(dispatched_at=time.time())))


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """A LoRA run: config.json with trainer.lora, run_id, a replay log, adapters v1 and v2."""
    run = tmp_path_factory.mktemp("lora") / "run"
    run.mkdir()
    (run / "config.json").write_bytes(msgspec.json.encode(_run_config(tiny_model_dir)))
    (run / "run_id").write_text(RUN_ID + "\n")
    models = {0: _base(tiny_model_dir), 1: _adapter(tiny_model_dir, 1), 2: _adapter(tiny_model_dir, 2)}
    for v in (1, 2):
        _publish(run, v, models[v])
    gen = torch.Generator().manual_seed(3)
    _write_rollouts(run, tiny_model_dir, models, gen)
    ids = torch.randint(3, 1000, (2, 16), generator=gen)
    return {"base": tiny_model_dir, "run": run, "models": models, "ids": ids,
            "logits": {v: _logits(m, ids) for v, m in models.items()}}


def _copy_run(world, dest: Path) -> Path:
    shutil.copytree(world["run"], dest)
    return dest


# --- replay: VersionStore -------------------------------------------------------------------


def test_an_adapter_version_is_the_base_plus_the_adapter_never_stacked(world):
    from replay.analysis.versions import VersionStore

    store = VersionStore(world["run"], str(world["base"]))
    ids, want = world["ids"], world["logits"]
    assert store.retained() == [0, 1, 2]
    assert store.source(1) == world["run"] / "weights" / "v00000001"
    base_state = {k: v.clone() for k, v in store.model(0).state_dict().items()}
    assert torch.allclose(_logits(store.model(1), ids), want[1], atol=1e-5, rtol=0)
    assert not torch.allclose(want[1], want[0], atol=1e-2)  # the adapter changes the outputs
    merged_1 = {k: v.clone() for k, v in store.model(1).state_dict().items()}
    changed = {k for k in base_state if not torch.equal(base_state[k], merged_1[k])}
    assert changed == {f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in TARGETS}
    # Back to the base: bit for bit.
    state = store.model(0).state_dict()
    assert all(torch.equal(state[k], base_state[k]) for k in base_state)
    assert torch.equal(_logits(store.model(0), ids), want[0])
    # v2 then v1 twice: v1 is merged into the base, never into v2's weights.
    assert torch.allclose(_logits(store.model(2), ids), want[2], atol=1e-5, rtol=0)
    for _ in range(2):
        state = store.model(1).state_dict()
        assert all(torch.equal(state[k], merged_1[k]) for k in merged_1)
    # A --target directory that is an adapter is merged into the base too.
    assert torch.allclose(_logits(store.model_from_dir(world["run"] / "weights" / "v00000002"), ids), want[2],
                          atol=1e-5, rtol=0)


def _corrupt(version_dir: Path, how: str) -> str:
    """Break the adapter in `version_dir`; returns what the error must name."""
    weights = version_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    if how == "unparsable":
        weights.write_bytes(b"\x00garbage")
        return "adapter_model.safetensors"
    if how == "no_b":
        del tensors[q_a.replace("lora_A", "lora_B")]
        save_file(tensors, weights)
        return q_a
    if how == "missing_target":
        gone = q_a.replace("layers.0", "layers.9")
        tensors[gone] = tensors.pop(q_a)
        tensors[gone.replace("lora_A", "lora_B")] = tensors.pop(q_a.replace("lora_A", "lora_B"))
        save_file(tensors, weights)
        return gone
    if how == "shape":
        tensors[q_a] = torch.zeros(RANK, 7)
        save_file(tensors, weights)
        return q_a
    config = json.loads((version_dir / "adapter_config.json").read_text())
    (version_dir / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    return "use_rslora"


@pytest.mark.parametrize("how", ["unparsable", "no_b", "missing_target", "shape", "rslora"])
def test_a_corrupt_adapter_is_refused_naming_the_file_and_tensor(world, tmp_path, how):
    from replay.analysis.versions import VersionStore

    run = _copy_run(world, tmp_path / "run")
    named = _corrupt(run / "weights" / "v00000002", how)
    store = VersionStore(run, str(world["base"]))
    assert torch.allclose(_logits(store.model(1), world["ids"]), world["logits"][1], atol=1e-5, rtol=0)
    with pytest.raises(AdapterError) as error:
        store.model(2)
    assert named in str(error.value) and "v00000002" in str(error.value), error.value
    # Refused before any weight was written: the model still holds version 1.
    assert torch.allclose(_logits(store.model(1), world["ids"]), world["logits"][1], atol=1e-5, rtol=0)
    # The export refuses it the same way, as a ModelError, and leaves nothing behind.
    with pytest.raises(ModelError, match=named.replace(".", r"\.")):
        export_model(run, 2, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.export-*"))


def test_verify_spans_recomputes_lora_versions_as_base_plus_adapter(world, tmp_path, capsys):
    from replay.analysis.analyze import Options, analyze

    report, _ = analyze(world["run"], Options(verify_spans=True, device="cpu"))
    verify = report["verify_spans"]
    tokens = sum(len(r.completion_tokens()) for r in read_records(world["run"]) if isinstance(r, RolloutRecord))
    assert report["skipped_versions"] == [] and report["log"]["retained_versions"] == [0, 1, 2]
    assert verify["passed"] and verify["tokens"] == verify["checked_tokens"] == tokens
    assert verify["max_abs_diff"] < 1e-4
    # Swapped adapters: the tokens of v1 and v2 no longer reproduce (exit 1 from the CLI).
    run = _copy_run(world, tmp_path / "swapped")
    a, b = run / "weights" / "v00000001", run / "weights" / "v00000002"
    a.rename(run / "weights" / "tmp")
    b.rename(a)
    (run / "weights" / "tmp").rename(b)
    assert main(["replay", str(run), "--verify-spans", "--json", "--device", "cpu"]) == 1
    failed = json.loads(capsys.readouterr().out)["verify_spans"]
    assert failed["first_failure"]["version"] in (1, 2) and failed["max_abs_diff"] > 1e-3
    assert np.isfinite(failed["max_abs_diff"])


# --- export-model -------------------------------------------------------------------------------


def test_export_writes_the_adapter_directory_peft_loads(world, tmp_path):
    from peft import PeftModel

    from orchestrator.run.recording import policy_identity

    result = export_model(world["run"], "latest", out_dir=tmp_path / "out")
    assert (result.version, result.source, result.form) == (2, "published", "adapter")
    out = result.path
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    published = world["run"] / "weights" / "v00000002"
    assert (out / "adapter_model.safetensors").read_bytes() == (published / "adapter_model.safetensors").read_bytes()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(world["base"].resolve())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    loaded = PeftModel.from_pretrained(_base(world["base"]), out).eval()
    assert torch.allclose(_logits(loaded, world["ids"]), world["logits"][2], atol=1e-5, rtol=0)
    card = (out / "README.md").read_text()
    identity = policy_identity(world["base"], "float32", "raw_logprobs")
    assert f"# version 2 of run {RUN_ID}" in card and "library_name: peft" in card
    assert f"| base model | `{world['base'].resolve()}` |" in card
    assert f"`{identity.base_checkpoint}` (recorded by the run" in card
    assert "| LoRA adapter | rank 8, alpha 16 (scale 2)" in card


def test_export_merge_writes_a_full_model_equal_to_base_plus_adapter(world, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert main(["export-model", str(world["run"]), str(out), "--version", "1", "--merge"]) == 0
    assert "(published, merged:" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.allclose(_logits(model, world["ids"]), world["logits"][1], atol=1e-5, rtol=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (world["base"] / name).read_bytes(), name
    assert not (out / "adapter_config.json").exists()
    card = (out / "README.md").read_text()
    assert "| LoRA adapter | rank 8, alpha 16 (scale 2), 4 weights adapted, merged into the base |" in card


def test_version_0_of_a_lora_run_needs_merge(world, tmp_path):
    with pytest.raises(ConfigError, match="version 0 of a LoRA run is the base model.*--merge") as error:
        export_model(world["run"], 0, out_dir=tmp_path / "out")
    assert error.value.field == "--version" and not (tmp_path / "out").exists()
    result = export_model(world["run"], 0, out_dir=tmp_path / "out", merge=True)
    assert (result.source, result.form) == ("base", "model")
    want = world["models"][0].state_dict()
    got = _base(result.path).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_only_version_exports_with_a_config_from_trainer_lora(world, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from orchestrator.trainer import checkpoint

    run = _copy_run(world, tmp_path / "run")
    shutil.rmtree(run / "weights" / "v00000002")  # pruned by keep_last: only the checkpoint holds it
    step = checkpoint.checkpoint_dir(run, 2)
    step.mkdir(parents=True)
    state = get_peft_model_state_dict(world["models"][2])
    save_file({k: v.contiguous() for k, v in state.items()}, step / checkpoint.MODEL_FILE)
    meta = checkpoint.CheckpointMeta(step=2, version=2, created_unix=time.time(),
                                     consumption=checkpoint.Consumption([], [], [], [], 0.0, 0.0, {}))
    (step / checkpoint.META_FILE).write_bytes(msgspec.json.encode(meta))
    result = export_model(run, "latest", out_dir=tmp_path / "adapter")
    assert (result.version, result.source, result.form) == (2, "checkpoint", "adapter")
    config = json.loads((result.path / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "target_modules", "bias")} == \
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": float(ALPHA),
         "target_modules": TARGETS, "bias": "none"}
    loaded = PeftModel.from_pretrained(_base(world["base"]), result.path).eval()
    assert torch.allclose(_logits(loaded, world["ids"]), world["logits"][2], atol=1e-5, rtol=0)
    merged = export_model(run, 2, out_dir=tmp_path / "merged", merge=True)
    assert (merged.source, merged.form) == ("checkpoint", "merged")
    model = AutoModelForCausalLM.from_pretrained(merged.path, dtype=torch.float32).eval()
    assert torch.allclose(_logits(model, world["ids"]), world["logits"][2], atol=1e-5, rtol=0)
    assert "the trainer checkpoint" in (merged.path / "README.md").read_text()


def test_an_adapter_is_not_exported_onto_a_base_whose_weights_changed(world, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(world["base"], base)
    run = _copy_run(world, tmp_path / "run")
    records = list(read_records(run))
    shutil.rmtree(run / "replay")
    with ReplayLog.open(run) as log:  # the same run, on the copied base
        for record in records:
            if isinstance(record, RunMetaRecord):
                from orchestrator.run.recording import policy_identity

                record = msgspec.structs.replace(record, identity=policy_identity(base, "float32", "raw_logprobs"),
                                                 config={**record.config, "model_dir": str(base)})
            log.append(record)
    assert export_model(run, 1, out_dir=tmp_path / "ok").form == "adapter"
    weights = load_file(base / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="its weights changed since the run"):
        export_model(run, 1, out_dir=tmp_path / "out")
