"""`inflight replay` on a synthetic run whose versions differ by known perturbations.

The run is built here without an engine: version 0 is a tiny-rl model, version k is version 0
plus k times one fixed Gaussian perturbation (policies drift further apart with lag), each
version is written as the filesystem transport lays it out (per-bucket safetensors, manifest,
COMPLETE), and rollouts are sampled from version v with transformers, their sampled logprobs
recorded in a real replay log. The expected numbers are computed here with plain torch, not
with replay.analysis.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from replay.log import FsyncPolicy, ReplayLog, read_records
from replay.records import (
    ActivationRecord,
    ConsumptionRecord,
    EngineActivation,
    PolicyIdentity,
    RolloutRecord,
    RunMetaRecord,
    SamplingSettings,
    Timings,
)
from tests.helpers import load_safetensors_dir

# Building the model and sampling the log takes a minute or two on a shared CPU, inside the
# timeout of whichever test runs first.
pytestmark = [pytest.mark.slow, pytest.mark.light_lane]
VERSIONS = 5  # 0..4
PER_VERSION = 8
COMPLETION = 24
NOISE = 0.1  # each version moves this far along one fixed random direction (x tensor std)


_load_dir = load_safetensors_dir


def _write_version(run_dir: Path, version: int, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    out = run_dir / "weights" / f"v{version:08d}"
    out.mkdir(parents=True)
    names = sorted(state)
    half = len(names) // 2  # two buckets: the reader must merge every file
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: state[n].contiguous() for n in part}, str(out / f"bucket-{i:05d}.safetensors"))
    (out / "manifest.json").write_text(json.dumps({"version": version}))
    (out / "COMPLETE").write_text("")


@torch.no_grad()
def _sample(model, prompt: list[int], n: int, gen: torch.Generator, temperature: float = 1.0):
    ids = list(prompt)
    tokens, logprobs = [], []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float() / temperature
        lp = torch.log_softmax(logits, -1)
        token = int(torch.multinomial(lp.exp(), 1, generator=gen))
        tokens.append(token)
        logprobs.append(float(lp[token]))
        ids.append(token)
    return tokens, logprobs


def _identity(base: Path, mode: str = "raw_logprobs") -> PolicyIdentity:
    return PolicyIdentity(base_checkpoint=f"{base}@sha256:0", tokenizer_hash="", chat_template_hash="",
                          serving_precision="float32", logprobs_mode=mode)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model on a shared CPU: one intra-op thread (spinning OpenMP threads on a busy
    machine made each forward ~100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread, rl_model):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("replay-analysis")
    base = rl_model  # the session's tiny-rl (tests/conftest.py), read only
    run_dir = root / "run"
    gen = torch.Generator().manual_seed(1)
    base_state = _load_dir(base)
    direction = {n: t.std().clamp(min=0.02) * torch.randn(t.shape, generator=gen) for n, t in base_state.items()}
    states = [base_state]
    for k in range(1, VERSIONS):  # version k = base + k * NOISE * direction: a known, growing drift
        states.append({n: (t + k * NOISE * direction[n]).contiguous() for n, t in base_state.items()})
        _write_version(run_dir, k, states[k])
    models = []
    for state in states:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        model.load_state_dict(state, strict=False)
        models.append(model)

    rollouts = []  # (rollout_id, prompt, tokens, logprobs, per-token versions, temperature)
    rid = 0
    for v in range(VERSIONS):
        for _ in range(PER_VERSION):
            prompt = torch.randint(3, 1000, (8,), generator=gen).tolist()
            tokens, lps = _sample(models[v], prompt, COMPLETION, gen)
            rollouts.append((rid, prompt, tokens, lps, [v] * COMPLETION, 1.0))
            rid += 1
    # Spanning v2 -> v3 at token 10, every position recomputed under the new weights.
    for _ in range(4):
        prompt = torch.randint(3, 1000, (8,), generator=gen).tolist()
        head, head_lp = _sample(models[2], prompt, 10, gen)
        tail, tail_lp = _sample(models[3], prompt + head, COMPLETION - 10, gen)
        rollouts.append((rid, prompt, head + tail, head_lp + tail_lp, [2] * 10 + [3] * (COMPLETION - 10), 1.0))
        rid += 1
    # Temperature-scaled (processed) logprobs at T = 0.7 under version 1.
    for _ in range(2):
        prompt = torch.randint(3, 1000, (8,), generator=gen).tolist()
        tokens, lps = _sample(models[1], prompt, COMPLETION, gen, temperature=0.7)
        rollouts.append((rid, prompt, tokens, lps, [1] * COMPLETION, 0.7))
        rid += 1

    with ReplayLog.open(run_dir, fsync=FsyncPolicy.every(1000)) as log:
        log.append(RunMetaRecord(run_id="synthetic", created_at=time.time(), identity=_identity(base),
                                 config={"model_dir": str(base)}))
        for v in range(1, VERSIONS):
            log.append(ActivationRecord(version=v, outcome="activated", kv_policy="recompute",
                                        engines=[EngineActivation("e0", 0.1, 0.01)]))
        for rid_, prompt, tokens, lps, versions, temperature in rollouts:
            mode = "processed_logprobs" if temperature != 1.0 else "raw_logprobs"
            log.append(RolloutRecord.from_lists(
                rollout_id=rid_, group_id=rid_ // 4, prompt_id=str(rid_ // 4), engine_id="e0",
                prompt_token_ids=prompt, completion_token_ids=tokens, completion_logprobs=lps,
                dispatched_version=versions[0], token_versions=versions, identity=_identity(base, mode),
                sampling=SamplingSettings(temperature=temperature), timings=Timings(dispatched_at=time.time())))
        # Step 1 consumed the version-0 rollouts; the trainer saw them at lag 0 (tiny mismatch).
        ids = [r[0] for r in rollouts if r[4][0] == 0]
        log.append(ConsumptionRecord.from_arrays(step=1, rollout_ids=ids, log_ratio_mean=[1e-7] * len(ids),
                                                 log_ratio_max_abs=[2e-6] * len(ids), version=1))
        ids = [r[0] for r in rollouts if r[4][0] == 1]
        log.append(ConsumptionRecord.from_arrays(step=3, rollout_ids=ids, log_ratio_mean=[0.05] * len(ids),
                                                 log_ratio_max_abs=[0.5] * len(ids), version=3))
    return {"base": base, "run": run_dir, "states": states, "models": models, "rollouts": rollouts}


def _copy_run(world, dest: Path, transform=None) -> Path:
    """The run's version files (and base) with its log rewritten through `transform`."""
    shutil.copytree(world["run"] / "weights", dest / "weights")
    with ReplayLog.open(dest, fsync=FsyncPolicy.every(1000)) as log:
        for record in read_records(world["run"]):
            log.append(transform(record) if transform else record)
    return dest


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", *args], check=False, capture_output=True,
                          text=True, timeout=400, env=env)


# --- the known-perturbation run -------------------------------------------------------------


@pytest.mark.timeout(600)
def test_kl_rises_with_lag_as_computed_independently(world):
    from replay.analysis.analyze import Options, analyze

    # The first VERSIONS * PER_VERSION rollouts of the log: single-version, T = 1.
    report, _ = analyze(world["run"], Options(target="latest", limit=VERSIONS * PER_VERSION))
    assert report["target"]["version"] == VERSIONS - 1
    target = world["models"][VERSIONS - 1]
    expected_k3: dict[int, list[float]] = {}
    exact_kl: dict[int, list[float]] = {}
    with torch.no_grad():
        for _, prompt, tokens, lps, versions, temperature in world["rollouts"]:
            if temperature != 1.0 or len(set(versions)) > 1:
                continue
            ids = torch.tensor([prompt + tokens])
            logp_t = torch.log_softmax(target(ids).logits[0, len(prompt) - 1:-1].double(), -1)
            logq = torch.log_softmax(world["models"][versions[0]](ids).logits[0, len(prompt) - 1:-1].double(), -1)
            r = logp_t.gather(1, torch.tensor(tokens)[:, None])[:, 0] - torch.tensor(lps, dtype=torch.float64)
            lag = VERSIONS - 1 - versions[0]
            expected_k3.setdefault(lag, []).extend(((r.exp() - 1) - r).tolist())
            exact_kl.setdefault(lag, []).extend((logq.exp() * (logq - logp_t)).sum(-1).tolist())
    by_lag = {row["lag"]: row for row in report["by_lag"]}
    assert set(by_lag) == set(range(VERSIONS))
    assert by_lag[0]["kl_k3"] < 1e-5  # the target scoring its own samples
    exact = [float(np.mean(exact_kl[lag])) for lag in range(VERSIONS)]
    assert all(a < b for a, b in itertools.pairwise(exact)), exact
    for lag in range(VERSIONS):  # the same tokens scored independently give the same estimate
        assert by_lag[lag]["kl_k3"] == pytest.approx(float(np.mean(expected_k3[lag])), rel=1e-3, abs=1e-6)
        assert by_lag[lag]["tokens"] == len(expected_k3[lag])
    measured = [by_lag[lag]["kl_k3"] for lag in range(VERSIONS)]
    assert all(a < b for a, b in itertools.pairwise(measured)), measured
    # k3 is an unbiased estimate of the exact KL: same order of magnitude at the largest lag
    assert 0.5 * exact[-1] < measured[-1] < 2.0 * exact[-1]
    for row in report["by_lag"]:
        assert 0.0 <= row["clip_fraction"] <= 1.0 and row["ratio_p50"] <= row["ratio_p99"]
    assert report["skipped_versions"] == []
    whole, _ = analyze(world["run"], Options(target="latest"))  # with the spanning rollouts
    assert {row["span"] for row in whole["by_span"]} == {"single", "multi"}
    assert whole["tokens"] == sum(len(r[2]) for r in world["rollouts"])


@pytest.mark.timeout(600)
def test_verify_spans_exact_on_a_faithful_log(world):
    from replay.analysis.analyze import Options, analyze

    report, _ = analyze(world["run"], Options(verify_spans=True))
    verify = report["verify_spans"]
    assert verify["passed"] and verify["first_failure"] is None
    assert verify["tokens"] == verify["checked_tokens"] == sum(len(r[2]) for r in world["rollouts"])
    assert report["verify_spans_max_abs_diff"] < 1e-4  # includes the T = 0.7 processed logprobs
    mismatch = report["trainer_mismatch"]
    steps = {row["step"]: row for row in mismatch["per_step"]}
    assert steps[1]["lag0_rollouts"] == PER_VERSION and steps[1]["lag0_log_ratio_max_abs"] == pytest.approx(2e-6)
    assert steps[3]["lag0_rollouts"] == 0 and steps[3]["log_ratio_max_abs"] == pytest.approx(0.5)
    assert mismatch["serving_precision"] == ["float32"]


def _shift_spans(record):
    """Every version change point one token later (the first token claims the previous
    version): what an off-by-one in version attribution would write."""
    if not isinstance(record, RolloutRecord):
        return record
    versions = record.expand_versions()
    if versions[0] == 0:
        return record
    shifted = np.concatenate([[versions[0] - 1], versions[:-1]])
    return msgspec.structs.replace(RolloutRecord.from_lists(
        rollout_id=record.rollout_id, group_id=record.group_id, prompt_id=record.prompt_id,
        engine_id=record.engine_id, prompt_token_ids=record.prompt_tokens(),
        completion_token_ids=record.completion_tokens(), completion_logprobs=record.logprobs(),
        dispatched_version=int(shifted[0]), token_versions=shifted, identity=record.identity,
        timings=record.timings, sampling=record.sampling))


@pytest.mark.timeout(600)
def test_verify_spans_fails_loudly_on_shifted_spans(world, tmp_path):
    run = _copy_run(world, tmp_path / "shifted", _shift_spans)
    result = _cli("replay", str(run), "--verify-spans", "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    failure = report["verify_spans"]["first_failure"]
    first_shifted = min(r[0] for r in world["rollouts"] if r[4][0] > 0)
    assert failure["rollout_id"] == first_shifted and failure["position"] == 0
    assert failure["version"] == world["rollouts"][first_shifted][4][0] - 1
    assert f"rollout {first_shifted} token 0 (version {failure['version']})" in result.stderr
    assert report["verify_spans_max_abs_diff"] > 1e-3


@pytest.mark.timeout(600)
def test_verify_spans_fails_on_swapped_version_files(world, tmp_path):
    from replay.analysis.analyze import Options, analyze

    run = _copy_run(world, tmp_path / "swapped")
    a, b = run / "weights" / "v00000002", run / "weights" / "v00000003"
    a.rename(run / "weights" / "tmp")
    b.rename(a)
    (run / "weights" / "tmp").rename(b)
    report, _ = analyze(run, Options(verify_spans=True))
    failure = report["verify_spans"]["first_failure"]
    assert not report["verify_spans"]["passed"]
    assert failure["version"] in (2, 3) and failure["abs_diff"] > 1e-3


@pytest.mark.timeout(600)
def test_pruned_version_is_skipped_and_reported(world, tmp_path):
    run = _copy_run(world, tmp_path / "pruned")
    shutil.rmtree(run / "weights" / "v00000001")
    result = _cli("replay", str(run), "--verify-spans", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["skipped_versions"] == [1]
    (skip,) = report["skipped"]
    v1_rollouts = [r for r in world["rollouts"] if 1 in r[4]]
    assert skip["needed_for"] == ["verify_spans"] and skip["rollouts"] == len(v1_rollouts)
    assert skip["tokens"] == sum(r[4].count(1) for r in v1_rollouts)
    assert "v00000001" in skip["reason"]
    assert report["verify_spans"]["passed"]
    assert report["verify_spans"]["tokens"] == sum(len(r[2]) for r in world["rollouts"]) - skip["tokens"]
    assert len(report["by_lag"]) == VERSIONS  # the target analysis is whole


@pytest.mark.timeout(600)
def test_pruned_target_reports_the_skip(world, tmp_path):
    from replay.analysis.analyze import Options, analyze

    run = _copy_run(world, tmp_path / "no-target")
    shutil.rmtree(run / "weights" / "v00000004")
    report, table = analyze(run, Options(target="latest", token_table=True))
    assert report["skipped_versions"] == [4] and report["by_lag"] == [] and table is None


def test_a_target_version_the_run_does_not_hold_exits_2_naming_those_it_holds(world):
    result = _cli("replay", str(world["run"]), "--target", "999")
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("inflight: error: --target 999: the run has no weights of version 999") and \
        "it holds versions [0, 1," in line, line
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(600)
def test_cli_json_keys_parquet_and_report(world, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "tokens.parquet"
    plots = tmp_path / "plots"
    result = _cli("replay", str(world["run"]), "--json", "--verify-spans", "--parquet", str(out),
                  "--plots", str(plots))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("by_lag", "verify_spans_max_abs_diff", "skipped_versions"):
        assert key in report
    for row in report["by_lag"]:
        assert isinstance(row["lag"], int)
        for key in ("tokens", "kl_k3", "ratio_p50", "ratio_p99", "clip_fraction"):
            assert key in row
    table = pq.read_table(out).to_pydict()
    assert list(table) == ["rollout_id", "position", "token_id", "version", "lag", "sampled_logprob",
                           "target_logprob", "log_ratio"]
    assert len(table["rollout_id"]) == report["tokens"]
    diff = np.array(table["target_logprob"]) - np.array(table["sampled_logprob"])
    assert np.allclose(diff, table["log_ratio"], atol=1e-5)
    assert set(table["lag"]) == {row["lag"] for row in report["by_lag"]}
    for name in ("kl_by_lag.png", "ratio_by_lag.png", "lag_per_step.png", "report.md", "report.html"):
        assert (plots / name).is_file(), name
    assert (plots / "kl_by_lag.png").read_bytes()[:4] == b"\x89PNG"
    assert "data:image/png;base64," in (plots / "report.html").read_text()
    assert "kl_by_lag.png" in (plots / "report.md").read_text()


@pytest.mark.timeout(600)
def test_target_model_dir_steps_and_limit(world):
    from replay.analysis.analyze import Options, analyze

    by_version, _ = analyze(world["run"], Options(target="0", limit=12))
    by_dir, _ = analyze(world["run"], Options(target=str(world["base"]), limit=12))
    assert by_version["rollouts"] == by_dir["rollouts"] == 12
    assert by_dir["target"]["model_dir"] and by_dir["target"]["lag_reference_version"] == VERSIONS - 1
    assert by_version["overall"]["kl_k3"] == pytest.approx(by_dir["overall"]["kl_k3"], abs=1e-9)
    stepped, _ = analyze(world["run"], Options(steps="3:3"))
    consumed = [r for r in world["rollouts"] if r[4][0] == 1]  # step 3 consumed version 1's
    assert stepped["rollouts"] == len(consumed)
    assert [row["step"] for row in stepped["per_step_lag"]] == [3]
    assert stepped["per_step_lag"][0]["histogram"] == {"1": len(consumed) * COMPLETION}


@pytest.mark.timeout(600)
def test_missing_base_model_is_one_line_error(world, tmp_path):
    run = tmp_path / "nobase"
    def meta_replaced(record):
        if not isinstance(record, RunMetaRecord):
            return record
        return msgspec.structs.replace(record, config={"model_dir": str(tmp_path / "gone")}, identity=None)

    _copy_run(world, run, meta_replaced)
    result = _cli("replay", str(run))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("inflight: error:") and "Traceback" not in result.stderr
    result = _cli("replay", str(tmp_path / "no-such-run"))
    assert result.returncode == 2 and "Traceback" not in result.stderr


@pytest.mark.timeout(600)
def test_batched_recompute_and_single_sequence_references_agree(world):
    from replay.analysis.recompute import (
        carried_logprobs,
        recompute_logprobs,
        sequence_logprobs,
    )

    models = dict(enumerate(world["models"]))
    picked = world["rollouts"][::7]
    batched = recompute_logprobs(models[2], [(np.array(r[1]), np.array(r[2])) for r in picked], token_budget=64)
    for (_, prompt, tokens, _, _, _), values in zip(picked, batched, strict=True):
        single = sequence_logprobs(models[2], prompt, tokens)
        assert np.allclose(values, single, atol=1e-5)
        assert np.allclose(carried_logprobs(models, prompt, tokens, [2] * len(tokens)), single, atol=1e-5)
    # keys/values carried across a switch differ from a full recompute under the new version
    _, prompt, tokens, _, versions, _ = next(r for r in world["rollouts"] if len(set(r[4])) > 1)
    carried = carried_logprobs(models, prompt, tokens, versions)
    full = [sequence_logprobs(models[v], prompt, tokens)[i] for i, v in enumerate(versions)]
    assert np.allclose(carried[:10], full[:10], atol=1e-5)
    assert np.abs(np.array(carried[10:]) - np.array(full[10:])).max() > 1e-4
