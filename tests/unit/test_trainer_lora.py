"""LoRA on the trainer side (`trainer.lora`), in one process on the locally built tiny model:
a step moves the adapter only; checkpoints hold the adapter and resume exactly; a checkpoint
of the other kind is refused; a target-module typo is a ConfigError; a published version is a
PEFT adapter directory that `check_adapter` accepts and PEFT loads with the trainer's logits;
old versions are pruned; a version lost in a crash is republished; and every corruption of an
adapter directory is an AdapterError naming the file and the tensor."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from orchestrator.config.run import LoraConfig, RunConfig, TrainerConfig, TransportConfig
from orchestrator.errors import ConfigError
from orchestrator.trainer import checkpoint, lora
from orchestrator.trainer.link import Batch, Sample, StepDone, pack_f32, pack_i32
from orchestrator.trainer.loss import logprob_path
from orchestrator.trainer.process import Trainer
from transports.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_MODEL,
    COMPLETE,
    adapter_dir,
    check_adapter,
    published_adapters,
    write_adapter,
)
from transports.errors import AdapterError, describe_error, rebuild_error

pytestmark = [pytest.mark.timeout(300), pytest.mark.light_lane]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, ALPHA = 4, 8.0


def _config(run_keep: int = 8, **lora_fields) -> RunConfig:
    fields = {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS, **lora_fields}
    return RunConfig(trainer=TrainerConfig(threads=1, lora=LoraConfig(**fields)),
                     transport=TransportConfig(keep_last=run_keep)).validate()


def _base(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batches(tiny_model_dir) -> dict[int, list[Sample]]:
    """Batches for steps 1-3: random tokens, logprobs of the base model (version 0) perturbed
    so that ratios vary, rewards varied within each group of 4."""
    base = _base(tiny_model_dir)
    out = {}
    for step in (1, 2, 3):
        rng = np.random.default_rng(step)
        samples = []
        for j in range(8):
            prompt = rng.integers(3, 1024, size=int(rng.integers(3, 8))).tolist()
            completion = rng.integers(3, 1024, size=int(rng.integers(2, 6))).tolist()
            with torch.no_grad():
                logits = base(input_ids=torch.tensor([prompt + completion])).logits[0]
            logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)[torch.arange(len(completion)),
                                                                     torch.tensor(completion)]
            recorded = logp.numpy() + rng.normal(0, 0.2, len(completion))
            samples.append(Sample(rollout_id=100 * step + j, group_id=10 * step + j // 4,
                                  prompt_token_ids=pack_i32(prompt), completion_token_ids=pack_i32(completion),
                                  logprobs=pack_f32(recorded.tolist()), reward=float(rng.random()),
                                  dispatched_version=step - 1))
        out[step] = samples
    return out


def _trainer(run_dir: Path, model_dir: Path, config: RunConfig, resume: bool = False) -> Trainer:
    trainer = Trainer(str(run_dir), str(model_dir), config)
    trainer.start(resume)
    return trainer


def _step(trainer: Trainer, step: int, batches) -> StepDone:
    done = trainer.handle(Batch(step=step, samples=batches[step]))
    assert isinstance(done, StepDone), done
    return done


def test_one_lora_step_moves_the_adapter_only(tiny_model_dir, batches, tmp_path):
    trainer = _trainer(tmp_path / "run", tiny_model_dir, _config())
    try:
        model = trainer.model
        # The chunked head path runs on the PeftModel (it hands on get_decoder / get_output_embeddings).
        assert lora.is_adapter(model) and logprob_path(model) == "split"
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        adapter = {n: p.detach().clone() for n, p in lora.adapter_parameters(model).items()}
        layers = model.config.num_hidden_layers
        assert len(adapter) == 2 * len(TARGETS) * layers and frozen
        assert all(".lora_" in n for n in adapter)
        # The optimizer covers the adapter alone.
        in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        assert in_optimizer == {id(p) for p in lora.adapter_parameters(model).values()}
        assert all(torch.count_nonzero(t) == 0 for n, t in adapter.items() if ".lora_B." in n)  # PEFT's init

        done = _step(trainer, 1, batches)
        assert np.isfinite(done.loss) and done.metrics["grad_norm"] > 0
        for name, before in frozen.items():
            assert torch.equal(dict(model.named_parameters())[name], before), name
        after = lora.adapter_parameters(model)
        for name, before in adapter.items():
            # lora_A's gradient is B^T times the rest, and B starts at zero: the first step moves B only.
            assert torch.equal(after[name], before) == (".lora_A." in name), name
        _step(trainer, 2, batches)
        for name, before in adapter.items():
            assert not torch.equal(after[name], before), name  # now every adapter weight has moved
        for name, before in frozen.items():
            assert torch.equal(dict(model.named_parameters())[name], before), name
        assert trainer.ready().plan_json == ""
    finally:
        trainer.close()


def test_the_adapters_initial_values_come_from_the_seed_alone(tiny_model_dir):
    first = lora.adapter_state(lora.wrap(_base(tiny_model_dir), _config().trainer.lora, seed=3))
    torch.manual_seed(12345)  # the global generator's state does not matter, and is left alone
    state = torch.get_rng_state()
    again = lora.adapter_state(lora.wrap(_base(tiny_model_dir), _config().trainer.lora, seed=3))
    assert torch.equal(torch.get_rng_state(), state)
    other = lora.adapter_state(lora.wrap(_base(tiny_model_dir), _config().trainer.lora, seed=4))
    name = next(n for n in first if ".lora_A." in n)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first[name], other[name])


def _adam(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in lora.adapter_parameters(trainer.model).items()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}


def test_a_resumed_lora_run_continues_exactly(tiny_model_dir, batches, tmp_path):
    """3 straight steps = 2 steps, a checkpoint, a new trainer resumed from it, 1 step: the same
    adapter and Adam state. LoRA dropout is on, so the torch generator must be restored too."""
    config = _config(run_keep=2, dropout=0.1)
    torch.manual_seed(0)
    straight = _trainer(tmp_path / "straight", tiny_model_dir, config)
    try:
        for step in (1, 2, 3):
            _step(straight, step, batches)
        want, want_adam = lora.adapter_state(straight.model), _adam(straight)
    finally:
        straight.close()

    run_dir = tmp_path / "resumed"
    torch.manual_seed(0)
    first = _trainer(run_dir, tiny_model_dir, config)
    try:
        _step(first, 1, batches)
        _step(first, 2, batches)
    finally:
        first.close()
    saved = checkpoint.checkpoint_dir(run_dir, 2)
    assert checkpoint.read_meta(run_dir, 2).lora is True
    from safetensors.torch import load_file

    assert set(load_file(saved / checkpoint.MODEL_FILE)) == set(want)  # the adapter alone, PEFT names
    torch.manual_seed(99)  # whatever the generator holds now, the checkpoint's is restored
    resumed = _trainer(run_dir, tiny_model_dir, config, resume=True)
    try:
        assert (resumed.step, resumed.resumed) == (2, True)
        _step(resumed, 3, batches)
        got, got_adam = lora.adapter_state(resumed.model), _adam(resumed)
    finally:
        resumed.close()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert got_adam.keys() == want_adam.keys()
    for name, state in want_adam.items():
        for key, value in state.items():
            torch.testing.assert_close(got_adam[name][key], value, atol=1e-6, rtol=0, msg=f"{name} {key}")
    assert published_adapters(run_dir / "weights") == [2, 3]  # transport.keep_last = 2


def test_a_checkpoint_of_the_other_kind_is_refused(tiny_model_dir, batches, tmp_path):
    full_run, lora_run = tmp_path / "full", tmp_path / "lora"
    full_config = RunConfig(trainer=TrainerConfig(threads=1), transport=TransportConfig(keep_last=8)).validate()
    for run_dir, config in ((full_run, full_config), (lora_run, _config())):
        trainer = _trainer(run_dir, tiny_model_dir, config)
        try:
            _step(trainer, 1, batches)
        finally:
            trainer.close()
    assert checkpoint.read_meta(full_run, 1).lora is False and checkpoint.read_meta(lora_run, 1).lora is True
    for run_dir, config, written, wanted in ((full_run, _config(), "a full-model run", "a LoRA run"),
                                             (lora_run, full_config, "a LoRA run", "a full-model run")):
        trainer = Trainer(str(run_dir), str(tiny_model_dir), config)
        with pytest.raises(RuntimeError) as err:
            trainer.start(resume=True)
        assert f"written by {written}" in str(err.value) and f"this trainer is {wanted}" in str(err.value)
        # checkpoint.load refuses it too, should anything call it directly.
        with pytest.raises(RuntimeError, match=f"written by {written}"):
            checkpoint.load(run_dir, 1, trainer.model, trainer.optimizer)


def test_a_meta_json_written_before_the_lora_field_still_reads(tmp_path):
    meta = checkpoint.CheckpointMeta(step=1, version=1, created_unix=0.0, consumption=checkpoint.Consumption(
        rollout_ids=[1], advantages=[0.5], log_ratio_mean=[None], log_ratio_max_abs=[None], reward_mean=1.0,
        loss=0.25, metrics={}))
    old = {k: v for k, v in msgspec.to_builtins(meta).items() if k != "lora"}
    path = checkpoint.checkpoint_dir(tmp_path, 1)
    path.mkdir(parents=True)
    (path / checkpoint.META_FILE).write_text(json.dumps(old))
    assert "lora" not in old and checkpoint.read_meta(tmp_path, 1) == meta and meta.lora is False


@pytest.mark.parametrize(("targets", "named"), [(["q_proj", "qproj"], "['qproj']"),
                                                (["self_attn.q_proj", "attn.v"], "['attn.v']"),
                                                (["input_layernorm"], "Qwen2RMSNorm")])
def test_a_target_module_the_model_cannot_wrap_is_a_config_error(tiny_model_dir, targets, named):
    with pytest.raises(ConfigError) as err:
        lora.wrap(_base(tiny_model_dir), LoraConfig(target_modules=targets), seed=0)
    assert err.value.field == "trainer.lora.target_modules"
    assert named in err.value.reason
    if named.startswith("["):  # a name no module has: what the model has is listed
        assert "'q_proj'" in err.value.reason and "'down_proj'" in err.value.reason


def test_a_published_version_is_what_peft_saves_and_loads_with_the_trainers_logits(tiny_model_dir, batches,
                                                                                      tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    trainer = _trainer(tmp_path / "run", tiny_model_dir, _config())
    try:
        _step(trainer, 1, batches)
        version = adapter_dir(trainer.publisher.root, 1)
        summary = check_adapter(version)
        layers = trainer.model.config.num_hidden_layers
        assert summary["rank"] == RANK and summary["alpha"] == ALPHA and summary["tensors"] == 2 * 4 * layers
        assert sorted(summary["target_modules"]) == sorted(TARGETS) and summary["bytes"] > 0
        assert sorted(p.name for p in version.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_MODEL, COMPLETE])
        names = set(load_file(version / ADAPTER_MODEL))
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names

        # Exactly what PeftModel.save_pretrained writes of the trainer's model.
        theirs = tmp_path / "save_pretrained"
        trainer.model.save_pretrained(theirs)
        ours_config = json.loads((version / ADAPTER_CONFIG).read_text())
        their_config = json.loads((theirs / ADAPTER_CONFIG).read_text())
        assert set(ours_config.pop("target_modules")) == set(their_config.pop("target_modules"))
        assert ours_config == their_config
        assert ours_config["base_model_name_or_path"] == str(tiny_model_dir)
        ours_tensors, their_tensors = load_file(version / ADAPTER_MODEL), load_file(theirs / ADAPTER_MODEL)
        assert ours_tensors.keys() == their_tensors.keys()
        assert all(torch.equal(ours_tensors[k], v) for k, v in their_tensors.items())
        assert check_adapter(theirs, complete=False)["tensors"] == summary["tensors"]

        ids = torch.tensor([[5, 17, 42, 8, 23, 11, 3, 29, 300, 777]])
        with torch.no_grad():
            trained = trainer.model(input_ids=ids).logits
            loaded = PeftModel.from_pretrained(_base(tiny_model_dir), str(version)).eval()
            served = loaded(input_ids=ids).logits
            base = _base(tiny_model_dir)(input_ids=ids).logits
        torch.testing.assert_close(served, trained, atol=1e-5, rtol=0)
        assert (trained - base).abs().max() > 1e-4  # the adapter moved the logits: the comparison means something
    finally:
        trainer.close()

    # vLLM's adapter reader (what a LoRARequest for this path loads) takes the directory as it is.
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_local_dir(str(version), max_position_embeddings=4096)
    assert (helper.r, helper.lora_alpha) == (RANK, ALPHA)
    read = LoRAModel.from_local_checkpoint(str(version), set(TARGETS), helper, lora_model_id=1, device="cpu",
                                           dtype=torch.float32)
    assert set(read.loras) == {f"model.layers.{i}.self_attn.{t}" for i in range(layers) for t in TARGETS}
    q = read.loras["model.layers.0.self_attn.q_proj"]
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    assert torch.equal(q.lora_a, ours_tensors[f"{prefix}.lora_A.weight"])
    assert torch.equal(q.lora_b, ours_tensors[f"{prefix}.lora_B.weight"]) and q.scaling == ALPHA / RANK


def test_a_version_lost_in_a_crash_is_republished_and_a_newer_one_refused(tiny_model_dir, batches, tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, tiny_model_dir, _config())
    try:
        _step(trainer, 1, batches)
    finally:
        trainer.close()
    weights = run_dir / "weights"
    # The crash came after the checkpoint, between the rename and COMPLETE.
    (adapter_dir(weights, 1) / COMPLETE).unlink()
    assert published_adapters(weights) == []
    resumed = _trainer(run_dir, tiny_model_dir, _config(), resume=True)
    resumed.close()
    assert published_adapters(weights) == [1]
    saved = load_file(checkpoint.checkpoint_dir(run_dir, 1) / checkpoint.MODEL_FILE)
    republished = load_file(adapter_dir(weights, 1) / ADAPTER_MODEL)
    assert saved.keys() == republished.keys() and all(torch.equal(saved[k], v) for k, v in republished.items())

    # A weights dir holding a version beyond the checkpoint: another weight set under that number.
    shutil.copytree(adapter_dir(weights, 1), adapter_dir(weights, 4))
    trainer = Trainer(str(run_dir), str(tiny_model_dir), _config())
    with pytest.raises(RuntimeError, match="holds version 4 but the trainer starts at step 1"):
        trainer.start(resume=True)


# -- the adapter directory: writer and validating reader, no model needed ---------------------

SHAPES = {"q": (16, 8), "v": (12, 8)}  # (out, in) of two small targets


def _tensors(r: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for module, (o, i) in SHAPES.items():
        prefix = f"base_model.model.model.layers.0.self_attn.{module}_proj"
        out[f"{prefix}.lora_A.weight"] = torch.randn(r, i, generator=g)
        out[f"{prefix}.lora_B.weight"] = torch.randn(o, r, generator=g)
    return out


def _adapter_config(r: int = 2) -> dict:
    return {"r": r, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def test_write_adapter_publishes_atomically_and_keeps_the_newest(tmp_path):
    root = tmp_path / "weights"
    for version in (1, 2, 3, 4):
        path = write_adapter(root, version, _tensors(), _adapter_config(), keep_last=2)
        assert path == adapter_dir(root, version) and (path / COMPLETE).is_file()
    assert published_adapters(root) == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == ["v00000003", "v00000004"]  # no temporary left
    assert check_adapter(adapter_dir(root, 4)) == {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"],
                                                   "tensors": 4, "bytes": (adapter_dir(root, 4) / ADAPTER_MODEL)
                                                   .stat().st_size}
    with pytest.raises(FileExistsError, match="already published"):
        write_adapter(root, 4, _tensors(), _adapter_config(), keep_last=2)
    # A directory left incomplete by a crash is replaced.
    (adapter_dir(root, 5)).mkdir()
    (adapter_dir(root, 5) / ADAPTER_MODEL).write_bytes(b"torn")
    write_adapter(root, 5, _tensors(), _adapter_config(), keep_last=2)
    assert published_adapters(root) == [4, 5] and check_adapter(adapter_dir(root, 5))["tensors"] == 4


def test_write_adapter_refuses_what_no_reader_would_accept(tmp_path):
    bad = _tensors()
    bad["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][3, 1] = float("nan")
    with pytest.raises(AdapterError, match="non-finite") as err:
        write_adapter(tmp_path, 1, bad, _adapter_config(), keep_last=2)
    assert err.value.tensor == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert published_adapters(tmp_path) == [] and not adapter_dir(tmp_path, 1).exists()


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _rewrite_tensors(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / ADAPTER_MODEL)
    change(tensors)
    save_file(tensors, str(path / ADAPTER_MODEL))


def _truncate(path: Path, size: int) -> None:
    data = (path / ADAPTER_MODEL).read_bytes()
    (path / ADAPTER_MODEL).write_bytes(data[:size])


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


def _edit_config(change):
    def edit(path: Path) -> None:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        change(config)
        (path / ADAPTER_CONFIG).write_text(json.dumps(config))
    return edit


def _header_garbage(path: Path) -> None:
    data = bytearray((path / ADAPTER_MODEL).read_bytes())
    data[8:12] = b"@@@@"
    (path / ADAPTER_MODEL).write_bytes(bytes(data))


def _nan(t):
    t[Q_A][0, 0] = float("nan")


def _inf(t):
    t[Q_B][1, 1] = float("-inf")


def _only_a_bias(t):
    t.clear()
    t["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.zeros(3)


CORRUPTIONS = {
    "no adapter_config.json": (lambda p: (p / ADAPTER_CONFIG).unlink(), ADAPTER_CONFIG, None, "missing"),
    "no adapter_model.safetensors": (lambda p: (p / ADAPTER_MODEL).unlink(), ADAPTER_MODEL, None, "missing"),
    "no COMPLETE": (lambda p: (p / COMPLETE).unlink(), COMPLETE, None, "not complete"),
    "config not JSON": (lambda p: (p / ADAPTER_CONFIG).write_text("{'r': 2"), ADAPTER_CONFIG, None, "not JSON"),
    "config a list": (lambda p: (p / ADAPTER_CONFIG).write_text("[2]"), ADAPTER_CONFIG, None, "not a JSON object"),
    "config without r": (_edit_config(lambda c: c.pop("r")), ADAPTER_CONFIG, None, "no 'r'"),
    "config without lora_alpha": (_edit_config(lambda c: c.pop("lora_alpha")), ADAPTER_CONFIG, None,
                                  "no 'lora_alpha'"),
    "config without target_modules": (_edit_config(lambda c: c.pop("target_modules")), ADAPTER_CONFIG, None,
                                      "no 'target_modules'"),
    "r not a number": (_edit_config(lambda c: c.update(r="2")), ADAPTER_CONFIG, None, "'r' must be an integer"),
    "header length torn": (lambda p: _truncate(p, 5), ADAPTER_MODEL, None, "byte offset 0"),
    "header torn": (lambda p: _truncate(p, 40), ADAPTER_MODEL, None, "the file ends at byte offset 40"),
    "header not JSON": (_header_garbage, ADAPTER_MODEL, None, "byte offsets 8 to"),
    "data torn": (lambda p: _truncate(p, (p / ADAPTER_MODEL).stat().st_size - 4), ADAPTER_MODEL,
                  "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight", "past the end of the file"),
    "lora_A without lora_B": (lambda p: _rewrite_tensors(p, lambda t: t.pop(Q_B)), ADAPTER_MODEL, Q_A,
                              "lora_A without its lora_B"),
    "lora_B without lora_A": (lambda p: _rewrite_tensors(p, lambda t: t.pop(Q_A)), ADAPTER_MODEL, Q_B,
                              "lora_B without its lora_A"),
    "A rank disagrees with r": (lambda p: _rewrite_tensors(p, _set(Q_A, torch.zeros(3, 8))), ADAPTER_MODEL, Q_A,
                                "disagrees with r = 2"),
    "B rank disagrees with r": (lambda p: _rewrite_tensors(p, _set(Q_B, torch.zeros(16, 3))), ADAPTER_MODEL, Q_B,
                                "disagrees with r = 2"),
    "A not 2-D": (lambda p: _rewrite_tensors(p, _set(Q_A, torch.zeros(2, 8, 1))), ADAPTER_MODEL, Q_A,
                  "must be [r, in]"),
    "NaN": (lambda p: _rewrite_tensors(p, _nan), ADAPTER_MODEL, Q_A, "1 non-finite value(s)"),
    "inf": (lambda p: _rewrite_tensors(p, _inf), ADAPTER_MODEL, Q_B, "1 non-finite value(s)"),
    "integer factor": (lambda p: _rewrite_tensors(p, _set(Q_A, torch.zeros(2, 8, dtype=torch.int32))),
                       ADAPTER_MODEL, Q_A, "must be floating point"),
    "no LoRA tensors": (lambda p: _rewrite_tensors(p, _only_a_bias), ADAPTER_MODEL, None, "no lora_A/lora_B tensors"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_check_adapter_names_the_file_and_tensor_of_each_corruption(tmp_path, case):
    corrupt, file, tensor, reason = CORRUPTIONS[case]
    path = write_adapter(tmp_path, 7, _tensors(), _adapter_config(), keep_last=2)
    check_adapter(path)  # whole before the corruption
    corrupt(path)
    with pytest.raises(AdapterError) as err:
        check_adapter(path)
    assert err.value.path == str(path / file)
    assert err.value.tensor == tensor
    assert reason in str(err.value) and str(path / file) in str(err.value)
    if tensor is not None:
        assert repr(tensor) in str(err.value)
    # It crosses process boundaries intact, as every transport error does.
    for again in (pickle.loads(pickle.dumps(err.value)), rebuild_error(describe_error(err.value))):
        assert type(again) is AdapterError and str(again) == str(err.value) and again.tensor == tensor


def test_check_adapter_of_a_missing_directory(tmp_path):
    with pytest.raises(AdapterError, match="no such adapter directory") as err:
        check_adapter(tmp_path / "v00000009")
    assert err.value.path == str(tmp_path / "v00000009")


@pytest.mark.parametrize("loss", ["tis", "ppo"])
def test_with_lora_dropout_the_ratios_come_from_a_forward_without_it(tiny_model_dir, loss):
    """Samples whose behaviour logprobs are the adapter's own (on-policy, version 0): with LoRA
    dropout at 0.5 the ratios are exactly 1 and the mismatch KL 0, as without dropout (before,
    the dropout-masked forward's noise was reported as off-policy mismatch); the dropout still
    shapes the gradient (two seeds, two different adapter updates)."""
    from orchestrator.trainer.step import train_step

    lora_config = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS, dropout=0.5)
    trainer_config = msgspec.structs.replace(TrainerConfig(threads=1, lora=lora_config), loss=loss)
    model = lora.wrap(_base(tiny_model_dir), lora_config, seed=0)
    for name, p in lora.adapter_parameters(model).items():  # B = 0 at start: make the adapter act
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    assert lora.has_dropout(model)
    rng = np.random.default_rng(0)
    samples = []
    for j in range(8):
        prompt = rng.integers(3, 1024, size=5).tolist()
        completion = rng.integers(3, 1024, size=6).tolist()
        with torch.no_grad(), lora.dropout_off(model):
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
        logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)[torch.arange(6), torch.tensor(completion)]
        samples.append(Sample(rollout_id=j, group_id=j // 4, prompt_token_ids=pack_i32(prompt),
                              completion_token_ids=pack_i32(completion), logprobs=pack_f32(logp.tolist()),
                              reward=float(j % 4), dispatched_version=0))
    updates = []
    for seed in (1, 2):
        state = {k: v.detach().clone() for k, v in lora.adapter_parameters(model).items()}
        optimizer = torch.optim.SGD(list(lora.adapter_parameters(model).values()), lr=0.1)
        torch.manual_seed(seed)
        result = train_step(model, optimizer, samples, trainer_config, pad_id=0)
        assert result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4), result.metrics
        assert result.metrics["kl_k3"] == pytest.approx(0.0, abs=1e-6) and result.metrics["clipped_frac"] == 0.0
        assert max(abs(x) for x in result.log_ratio_mean) < 1e-4
        updates.append({k: (v.detach() - state[k]) for k, v in lora.adapter_parameters(model).items()})
        with torch.no_grad():  # back to the start for the next seed
            for k, v in lora.adapter_parameters(model).items():
                v.copy_(state[k])
    assert any(not torch.allclose(updates[0][k], updates[1][k]) for k in updates[0]), "dropout had no effect"
