"""A multi-turn episode in the replay log (issue #19): one token sequence whose environment
spans (tool output, feedback, turn delimiters) carry no logprob. `inflight stats` reports
turns and the environment's token share and counts only sampled tokens; `--verify-spans`
checks every sampled token of every turn under its own version and none of the environment's;
the Parquet token table leaves their logprob null."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from orchestrator.commands.cli import main
from replay.log import FsyncPolicy, ReplayLog
from replay.records import RolloutRecord, RunMetaRecord, SamplingSettings, Timings
from tests.unit.sample_helpers import sample_tokens

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

NAN = float("nan")




def _episode(model, gen) -> tuple[list[int], list[int], list[float], list[tuple[int, int]]]:
    """Three model turns with environment tokens between them, sampled by `model` (version 0)."""
    prompt = torch.randint(3, 1000, (5,), generator=gen).tolist()
    tokens, logprobs, spans = [], [], []
    for turn in range(3):
        if turn:
            env = torch.randint(3, 1000, (4,), generator=gen).tolist()
            spans.append((len(tokens), len(tokens) + len(env)))
            tokens += env
            logprobs += [NAN] * len(env)
        sampled, lps = sample_tokens(model, prompt + tokens, 6, gen)
        tokens += sampled
        logprobs += lps
    return prompt, tokens, logprobs, spans


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> Path:
    from transformers import AutoModelForCausalLM

    from orchestrator.run.recording import policy_identity

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    run = tmp_path_factory.mktemp("episodes")
    identity = policy_identity(tiny_model_dir, "float32", "raw_logprobs")
    with ReplayLog.open(run, fsync=FsyncPolicy.every(1000)) as log:
        log.append(RunMetaRecord(run_id="episodes", created_at=time.time(), identity=identity,
                                 config={"model_dir": str(Path(tiny_model_dir).resolve())}))
        for rid in range(3):
            prompt, tokens, logprobs, spans = _episode(model, gen)
            log.append(RolloutRecord.from_lists(
                rollout_id=rid, group_id=0, prompt_id=str(rid), engine_id="e0", prompt_token_ids=prompt,
                completion_token_ids=tokens, completion_logprobs=logprobs, dispatched_version=0,
                identity=identity, sampling=SamplingSettings(temperature=1.0), timings=Timings(time.time()),
                environment_spans=spans, rewards={"reward": 1.0}))
        single, lps = sample_tokens(model, [7, 8, 9], 6, gen)
        log.append(RolloutRecord.from_lists(
            rollout_id=3, group_id=1, prompt_id="3", engine_id="e0", prompt_token_ids=[7, 8, 9],
            completion_token_ids=single, completion_logprobs=lps, dispatched_version=0, identity=identity,
            sampling=SamplingSettings(temperature=1.0), timings=Timings(time.time()), rewards={"reward": 0.0}))
    return run


def test_stats_report_turns_and_the_environment_token_share(run, capsys):
    assert main(["stats", str(run), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["turns"] == {"mean": (3 * 3 + 1) / 4, "max": 3}
    sampled, env = 3 * 18 + 6, 3 * 8
    assert stats["environment_token_share"] == pytest.approx(env / (env + sampled))
    assert sum(b["tokens"] for b in stats["dropped_stale_by_length"]) == sampled, "token counts: sampled only"


def test_verify_spans_checks_every_sampled_token_of_every_turn_and_no_environment_token(run, tmp_path, capsys):
    from replay.analysis.analyze import Options, analyze

    report, _ = analyze(run, Options(verify_spans=True, device="cpu"))
    verify = report["verify_spans"]
    assert verify["passed"] and verify["checked_tokens"] == 3 * 18 + 6 and verify["max_abs_diff"] < 1e-4
    assert report["overall"] is not None and np.isfinite(report["overall"]["kl_k3"])
    assert main(["export", str(run), "--parquet", str(tmp_path / "r.parquet"), "--tokens",
                 str(tmp_path / "t.parquet")]) == 0
    capsys.readouterr()
    tokens = pq.read_table(tmp_path / "t.parquet").to_pandas()
    assert int(tokens["logprob"].isna().sum()) == 3 * 8, "environment tokens: no logprob, null"
