"""The write path's checks (`encode_record_to`, as `ReplayLog.append` uses it): every field is
still type-checked through the nested shapes, a bad one is named, a refused record leaves
nothing behind, and the reused scratch buffer gives exactly the bytes `encode_record` gives."""

from __future__ import annotations

import math

import msgspec
import pytest

from replay.bench.log import synthetic_rollouts
from replay.errors import InvalidRecordError
from replay.log import FsyncPolicy, ReplayLog, read_records
from replay.records import (
    ActivationRecord,
    ConsumptionRecord,
    DiscardRecord,
    EngineActivation,
    Errored,
    PolicyIdentity,
    RolloutRecord,
    RunMetaRecord,
    SamplingSettings,
    Timings,
    decode_record,
    encode_record,
    encode_record_to,
)

IDENTITY = PolicyIdentity("ckpt", "tok", "tmpl", "bf16")


def rollout(rollout_id: int = 1, **overrides: object) -> RolloutRecord:
    fields: dict[str, object] = {
        "rollout_id": rollout_id, "group_id": 0, "prompt_id": "p", "engine_id": "e0",
        "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5, 6, 7],
        "completion_logprobs": [-0.1, -0.2, -0.3, -0.4], "dispatched_version": 3,
        "identity": IDENTITY, "timings": Timings(1.0, 1.5, 2.0), "rewards": {"reward": 1.0},
    }
    fields.update(overrides)
    return RolloutRecord.from_lists(**fields)  # type: ignore[arg-type]


def replaced(**changes: object) -> RolloutRecord:
    return msgspec.structs.replace(rollout(), **changes)


def with_reward(name: str, value: float) -> RolloutRecord:
    record = rollout()
    record.rewards[name] = value  # the dict inside a frozen record can still change
    return record


BAD = [
    (lambda: replaced(identity=PolicyIdentity(1, "tok", "tmpl", "bf16")), "identity.base_checkpoint"),
    (lambda: replaced(identity=PolicyIdentity("c", "t", "m", "bf16", logprobs_mode=3)),
     "identity.logprobs_mode"),
    (lambda: replaced(timings=Timings("now")), "timings.dispatched_at"),
    (lambda: replaced(timings=Timings(1.0, finished_at=True)), "timings.finished_at"),
    (lambda: replaced(sampling=SamplingSettings(top_k=1.5)), "sampling.top_k"),
    (lambda: replaced(sampling=SamplingSettings(stop=("a", 1))), "sampling.stop"),
    (lambda: replaced(sampling=SamplingSettings(stop_token_ids=(1, "x"))), "sampling.stop_token_ids"),
    (lambda: replaced(sampling=SamplingSettings(ignore_eos=1)), "sampling.ignore_eos"),
    (lambda: replaced(status=Errored(kind=1)), "status.kind"),
    (lambda: replaced(kv_carried_across_versions=1), "kv_carried_across_versions"),
    (lambda: replaced(group_id=True), "group_id"),
    (lambda: replaced(prompt_id=None), "prompt_id"),
    (lambda: replaced(rewards={1: 0.5}), "rewards"),
    (lambda: replaced(rewards={"reward": True}), "rewards"),
    (lambda: replaced(rewards=[1.0]), "rewards"),
    (lambda: replaced(rewards={"reward": 10**30}), "rewards"),  # no int that large encodes
    (lambda: with_reward("a", math.inf), "rewards.a"),
    (lambda: with_reward("b", math.nan), "rewards.b"),
    (lambda: replaced(sampling="greedy"), "sampling"),
    (lambda: ActivationRecord(version=3, outcome="activated",
                              engines=[EngineActivation(7, 1.0, 0.5)]), "engines"),
    (lambda: ConsumptionRecord(step=1, rollout_ids=[1], metrics={"loss": "low"}), "metrics"),
    (lambda: DiscardRecord(rollout_ids=[1], reason=2), "reason"),
    (lambda: RunMetaRecord(run_id=5, created_at=1.0), "run_id"),
]


@pytest.mark.parametrize("make, field", BAD)
def test_a_bad_field_is_named_by_the_write_path(tmp_path, make, field):
    record = make()
    scratch = bytearray()
    with pytest.raises(InvalidRecordError) as raised:
        encode_record_to(record, scratch)
    assert raised.value.field.startswith(field), raised.value
    with pytest.raises(InvalidRecordError) as raised:
        encode_record(record)
    assert raised.value.field.startswith(field), raised.value
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(3)) as log:
        log.append(rollout(0))
        with pytest.raises(InvalidRecordError) as raised:
            log.append(record)
        assert raised.value.field.startswith(field), raised.value
        log.append(rollout(2))
    assert [r.rollout_id for r in read_records(tmp_path)] == [0, 2]


def test_the_reused_scratch_gives_the_bytes_encode_record_gives(tmp_path):
    # Records of falling, rising and equal sizes, of every type, through one scratch buffer:
    # nothing of an earlier (longer) record is left behind.
    records: list[object] = list(synthetic_rollouts(5))
    records += [rollout(9, completion_token_ids=list(range(300)),
                        completion_logprobs=[-1.0] * 300), rollout(10)]
    records += [ActivationRecord(version=3, outcome="activated",
                                 engines=[EngineActivation("e0", 1.0, 0.5)]),
                ConsumptionRecord(step=1, rollout_ids=[1, 2], metrics={"loss": 0.5}),
                DiscardRecord(rollout_ids=[1], reason="stale"),
                RunMetaRecord(run_id="r", created_at=1.0, config={"a": [1, {"b": None}]})]
    scratch = bytearray()
    for record in records:
        encode_record_to(record, scratch)  # type: ignore[arg-type]
        assert bytes(scratch) == encode_record(record)  # type: ignore[arg-type]
        assert decode_record(scratch) == record
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(4)) as log:
        acks = [log.append(record) for record in records]  # type: ignore[arg-type]
    assert [ack.durable for ack in acks] == [i % 4 == 3 for i in range(len(records))]
    assert list(read_records(tmp_path)) == records


def test_a_refused_record_after_a_large_one_leaves_the_log_usable(tmp_path):
    big = rollout(1, completion_token_ids=list(range(100_000)),
                  completion_logprobs=[-1.0] * 100_000)
    with ReplayLog.open(tmp_path) as log:
        log.append(big)
        with pytest.raises(InvalidRecordError, match="sampling.temperature"):
            log.append(replaced(sampling=SamplingSettings(temperature="hot")))
        ack = log.append(rollout(2))
        assert ack.durable
    assert [r.rollout_id for r in read_records(tmp_path)] == [1, 2]
