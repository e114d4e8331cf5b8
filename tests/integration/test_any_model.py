"""Any Hugging Face model directory through `inflight run`, and its trained version back out with
`inflight export-model`: models written by transformers' own `save_pretrained` (no file of this
project in them): a dense Qwen2 with tied embeddings and a Llama, neither with a pad_token_id,
both carrying the tiny model's tokenizer (`AutoTokenizer.save_pretrained`).

Per architecture (one module-scoped run, export and vLLM engine each): the run trains three
steps in sync mode (so versions 1 and 2 are served and sampled from; staleness 0 throughout,
which `inflight stats` reports, and start-up reported by phase); `--version latest` exports
version 3 with the run's bytes; the newest version that sampled whole rollouts, exported too,
loads in vLLM and in transformers, and both give the log-probabilities the run recorded for
those rollouts.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from replay.log import read_records
from replay.records import ActivationRecord, ConsumptionRecord, RolloutRecord, RunMetaRecord
from tests.helpers import inflight_llm

# Sync mode, its own engines, bounds of minutes: it holds on any schedule, so it runs in the light
# lane beside the engine tests (tests/conftest.py).
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.light_lane]
INFLIGHT = str(Path(sys.executable).with_name("inflight"))
STEPS = 3
ARCHS = ["qwen2", "llama"]
# fp32. Measured on this machine (2026-12-01, both architectures): vLLM prompt logprobs of the
# exported version equal the logprobs the run's engine sampled exactly (max |diff| 0.0); a
# transformers forward of the export is within 4.8e-7 of them. The neighbouring version's
# export is 0.56 away (qwen2, v1 against v2's rollouts): a wrong version cannot pass.
VLLM_TOLERANCE = 1e-5
HF_TOLERANCE = 1e-5


def save_pretrained_model(arch: str, tokenizer_dir: Path, out: Path) -> Path:
    """A tiny random model written by transformers alone: hidden 128, 4 heads (size 32), 2 KV
    heads, 2 layers, fp32, no pad_token_id. Qwen2 ties its embeddings; Llama does not."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    assert model.config.pad_token_id is None
    model.to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    assert not (out / "inflight_model.json").exists()
    return out


def inflight(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([INFLIGHT, *args], capture_output=True, text=True, timeout=timeout)


class Trained(msgspec.Struct):
    arch: str
    model_dir: Path
    run_dir: Path
    latest: Path  # `--version latest`
    served: Path  # `--version SERVED`
    served_version: int
    records: list
    stdout: str  # the run's own output (its summary)


def whole_rollouts(records, version: int) -> list[RolloutRecord]:
    """Completed rollouts every token of which was sampled under `version`, no KV carried over."""
    return [r for r in records if isinstance(r, RolloutRecord) and r.status_name == "completed"
            and r.num_completion_tokens and r.change_points() == [(0, version)] and not r.kv_carried_across_versions]


@pytest.fixture(scope="module", params=ARCHS)
def trained(request, tmp_path_factory, tiny_model_dir) -> Trained:
    root = tmp_path_factory.mktemp(f"any-{request.param}")
    model_dir = save_pretrained_model(request.param, tiny_model_dir, root / "model")
    config = root / "run.toml"
    config.write_text(f"""
[engine]
model = "{model_dir}"
max_model_len = 256
[sampling]
max_tokens = 8
[scheduler]
group_size = 4
batch_groups = 2
mode = "sync"
[trainer]
start_timeout_s = 900  # the light lane's share of the CPU: its start can take minutes on CI
[run]
progress = "none"
tensorboard = false
[http]
enabled = false
""")
    run_dir = root / "run"
    done = inflight("run", str(config), "--run-dir", str(run_dir), "--max-steps", str(STEPS), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = list(read_records(run_dir))
    served_version = max(v for v in range(STEPS) if whole_rollouts(records, v))
    exported = {}
    for name, version in (("latest", "latest"), ("served", str(served_version))):
        out = inflight("export-model", str(run_dir), "--version", version, str(root / name), timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        exported[name] = root / name
    return Trained(request.param, model_dir, run_dir, exported["latest"], exported["served"], served_version,
                   records, done.stdout)


@pytest.fixture(scope="module")
def served_llm(trained):
    engine = inflight_llm(trained.served, max_model_len=256, enable_prefix_caching=False)
    yield engine
    del engine
    gc.collect()


def test_a_save_pretrained_model_trains_through_inflight_run(trained):
    from orchestrator.run.recording import weights_digest

    records = trained.records
    assert sorted(c.step for c in records if isinstance(c, ConsumptionRecord)) == list(range(1, STEPS + 1))
    activated = [a.version for a in records if isinstance(a, ActivationRecord) and a.outcome == "activated"]
    assert set(range(1, STEPS)) <= set(activated)  # sync mode: each step samples the newest version
    assert trained.served_version >= STEPS - 1
    # Used as it is: not rebuilt, no marker written; the identity names its files.
    assert not (trained.model_dir / "inflight_model.json").exists()
    meta = next(r for r in records if isinstance(r, RunMetaRecord))
    assert meta.identity.base_checkpoint == f"{trained.model_dir.resolve()}@sha256:{weights_digest(trained.model_dir)[:16]}"
    assert meta.identity.chat_template_hash and meta.identity.tokenizer_hash
    # Every version the run published still holds every tensor of the model, in fp32.
    published = sorted(p.name for p in (trained.run_dir / "weights").glob("v*"))
    assert published == [f"v{v:08d}" for v in range(1, STEPS + 1)]


def test_sync_mode_reports_staleness_zero_and_its_startup_by_phase(trained):
    """Sync mode (any model: the run here is one): every sample is consumed by the step right after
    the version that sampled it, and `inflight stats` says so; start-up is reported by phase, and
    the phases fit the order they ran in."""
    import json

    from tests.integration.test_run import check_log_invariants, stats_json

    check_log_invariants(trained.run_dir, STEPS)
    stats = stats_json(trained.run_dir)
    assert stats["staleness"]["max"] == 0 and stats["staleness"]["count"] == STEPS * 4 * 2  # group_size * batch_groups
    events = [json.loads(line) for line in (trained.run_dir / "orchestrator.jsonl").read_text().splitlines()]
    startup = next(e for e in events if e["event"] == "run.startup")
    first_batch = next(e for e in events if e["event"] == "run.first_batch")
    for phase in ("process_s", "model_s", "task_s", "trainer_s", "engines_s", "scoring_s", "fleet_s"):
        assert startup[phase] >= 0, phase
    assert startup["to_first_rollout_s"] >= startup["engines_s"] + startup["fleet_s"]
    assert startup["to_first_rollout_s"] >= startup["trainer_s"]
    assert first_batch["step"] == 1 and first_batch["seconds"] > startup["to_first_rollout_s"]
    assert "  startup     first rollout at" in trained.stdout


def test_latest_export_is_the_runs_newest_version_bit_for_bit(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.helpers import load_safetensors_dir

    run_weights = load_safetensors_dir(trained.run_dir / "weights" / f"v{STEPS:08d}")
    written = load_file(trained.latest / "model.safetensors")
    tied = trained.arch == "qwen2"
    # The checkpoint layout transformers writes: a tied head is stored once, as the embedding.
    assert sorted(written) == sorted(k for k in run_weights if not (tied and k == "lm_head.weight"))
    assert all(torch.equal(written[k], run_weights[k]) for k in written)
    model = AutoModelForCausalLM.from_pretrained(trained.latest)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[trained.arch]
    assert torch.equal(model.lm_head.weight, run_weights["lm_head.weight"])
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    card = (trained.latest / "README.md").read_text()
    run_id = (trained.run_dir / "run_id").read_text().strip()
    assert f"# version {STEPS} of run {run_id}" in card and str(trained.model_dir.resolve()) in card
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (trained.latest / name).read_bytes() == (trained.model_dir / name).read_bytes(), name


def _recorded(trained) -> list[RolloutRecord]:
    rollouts = whole_rollouts(trained.records, trained.served_version)
    assert len(rollouts) >= 4
    return rollouts


def test_the_served_versions_export_gives_the_recorded_logprobs_in_vllm(trained, served_llm):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    worst = 0.0
    for r in _recorded(trained):
        prompt, completion = r.prompt_tokens().tolist(), r.completion_tokens().tolist()
        out = served_llm.generate([{"prompt_token_ids": prompt + completion}], params, use_tqdm=False)[0]
        scored = out.prompt_logprobs[len(prompt):]
        got = torch.tensor([lp[t].logprob for t, lp in zip(completion, scored, strict=True)])
        worst = max(worst, float((got - torch.from_numpy(r.logprobs().copy())).abs().max()))
    print(f"\n{trained.arch}: vLLM on the export vs the run's recorded logprobs: max |diff| {worst:.2e}")
    assert worst <= VLLM_TOLERANCE


def test_the_served_versions_export_gives_the_recorded_logprobs_in_transformers(trained):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained.served, dtype=torch.float32).eval()
    worst = 0.0
    for r in _recorded(trained):
        prompt, completion = r.prompt_tokens().tolist(), r.completion_tokens().tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        got = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        worst = max(worst, float((got - torch.from_numpy(r.logprobs().copy())).abs().max()))
    print(f"\n{trained.arch}: transformers on the export vs the run's recorded logprobs: max |diff| {worst:.2e}")
    assert worst <= HF_TOLERANCE
    card = (trained.served / "README.md").read_text()
    assert f"policy version | {trained.served_version} (after trainer step {trained.served_version})" in card
