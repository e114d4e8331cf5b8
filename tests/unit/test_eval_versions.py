"""Held-out evaluation beside activations (issue #30 item 6): each sample's tokens counted by
version, the record labelled with the versions it came from (never one version when tokens came
from several), old eval records still read, and the trainer's per-step wait in `inflight stats`.
The run that shows it with a real engine and trainer: tests/integration/test_eval_run.py."""

from __future__ import annotations

import json

import msgspec
import pytest

from orchestrator.errors import ConfigError
from orchestrator.observe.progress import eval_versions
from orchestrator.run.eval import Sample, label, version_tokens
from replay.log import FsyncPolicy, ReplayLog, frame, read_records, segment_header
from replay.query import ColumnBuilder, Filters, compute_stats
from replay.records import ConsumptionRecord, EvalPrompt, EvalRecord
from tests.unit.test_replay_query import run_cli


def sample(rewards: float | None, **by_version: int) -> Sample:
    counts = {int(v.removeprefix("v")): n for v, n in by_version.items()}
    return Sample(0, None if rewards is None else {"reward": rewards}, sum(counts.values()), counts)


def test_tokens_are_counted_per_version_from_the_change_points():
    assert version_tokens([(0, 3)], 5, 3) == {3: 5}
    assert version_tokens([(0, 3), (2, 4), (6, 6)], 9, 3) == {3: 2, 4: 4, 6: 3}
    assert version_tokens([], 0, 7) == {7: 0}  # no token: the version it was dispatched at


def test_an_evaluation_is_labelled_with_every_version_and_the_one_that_sampled_most():
    samples = [[sample(1.0, v3=4), sample(0.0, v3=2, v4=6)],  # 6 + 10 tokens
               [sample(0.5, v4=8), sample(None, v5=16)]]       # the errored one is not counted
    version, versions, mixed = label(samples, due_version=3)
    assert (version, versions, mixed) == (4, [3, 4], 1)


def test_a_tie_goes_to_the_older_version_and_no_scored_sample_names_only_the_due_version():
    assert label([[sample(1.0, v3=4), sample(1.0, v4=4)]], due_version=3) == (3, [3, 4], 0)
    assert label([[sample(None, v5=4)]], due_version=5) == (5, [], 0)


def test_the_progress_line_never_shows_one_version_for_several():
    assert eval_versions(7, [7], 0) == "v7"
    assert eval_versions(7, [6, 7, 8], 3) == "v7 (v6-v8, 3 mixed)"


def test_eval_max_inflight_is_validated_by_name():
    from orchestrator.config.task import EvalConfig

    with pytest.raises(ConfigError) as raised:
        EvalConfig(max_inflight=0).validate()
    assert raised.value.field == "eval.max_inflight"


def _old_eval_bytes() -> bytes:
    """An eval record as written before versions were recorded (no versions, mixed, due_version,
    started_at; its results without per-sample versions)."""
    return msgspec.msgpack.encode({
        "type": "eval", "step": 4, "version": 4, "task": "digits", "k": 2, "prompts": 1,
        "mean_at_k": 0.5, "pass_at_k": 1.0, "pass_threshold": 1.0,
        "results": [{"prompt_id": "p0", "rewards": [1.0, 0.0], "completion_tokens": [3, 5], "errored": 0}],
        "components": {}, "at": 10.0, "seconds": 1.5})


def stats_of(run_dir, capsys) -> dict:
    assert run_cli(["stats", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_eval_record_of_an_older_log_reads_as_one_version(tmp_path, capsys):
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "00000001.seg").write_bytes(segment_header(1) + frame(_old_eval_bytes()))
    [record] = list(read_records(tmp_path))
    assert isinstance(record, EvalRecord)
    assert (record.versions, record.mixed, record.due_version, record.results[0].versions) == ([], 0, None, [])
    [shown] = stats_of(tmp_path, capsys)["eval"]
    assert (shown["version"], shown["versions"], shown["mixed"], shown["due_version"]) == (4, [4], 0, None)


def test_stats_show_a_mixed_evaluation_and_the_trainers_wait_per_step(tmp_path, capsys):
    mixed = EvalRecord(step=2, version=3, task="digits", k=2, prompts=1, mean_at_k=0.5, pass_at_k=1.0,
                       pass_threshold=1.0, results=[EvalPrompt("p0", [1.0, 0.0], [4, 4], 0, [[2, 3], [3]])],
                       versions=[2, 3], mixed=1, due_version=2, started_at=9.0, at=10.0)
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(1000)) as log:
        log.append(ConsumptionRecord(step=1, rollout_ids=[], metrics={"train_s": 0.5}))  # a first step: no wait
        log.append(ConsumptionRecord(step=2, rollout_ids=[], metrics={"wait_s": 0.25}))
        log.append(ConsumptionRecord(step=3, rollout_ids=[], metrics={"wait_s": 0.75}))
        log.append(mixed)
    assert list(read_records(tmp_path))[-1] == mixed  # the new fields round-trip
    scanned = stats_of(tmp_path, capsys)
    [shown] = scanned["eval"]
    assert (shown["version"], shown["versions"], shown["mixed"], shown["due_version"]) == (3, [2, 3], 1, 2)
    assert scanned["trainer_wait_s"]["count"] == 2 and scanned["trainer_wait_s"]["mean"] == pytest.approx(0.5)
    builder = ColumnBuilder()
    for record in read_records(tmp_path):
        builder.add(record)
    live = compute_stats(builder.build(), Filters())  # /stats: the same numbers, one record at a time
    assert live["trainer_wait_s"] == scanned["trainer_wait_s"] and live["eval"] == scanned["eval"]
    windowed = compute_stats(builder.build(), Filters(step_min=3))
    assert windowed["trainer_wait_s"]["count"] == 1 and windowed["trainer_wait_s"]["max"] == 0.75
    assert run_cli(["stats", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "trainer waited for its batch: mean 0.5s" in text and "2,3" in text
