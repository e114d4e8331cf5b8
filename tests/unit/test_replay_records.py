"""Replay records: building, invariants, refusal of bad records, and schema evolution.

The golden segment in tests/fixtures/replay/ was written once from `golden_records()`; if a
field is reordered, renamed or retyped, or the framing changes, the bytes no longer match.
Regenerate it only for a deliberate format change (and bump FORMAT_VERSION):
    python -c "from tests.unit.test_replay_records import write_golden; write_golden()"
"""

from __future__ import annotations

import math
import shutil
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest

from replay.errors import InvalidRecordError, UnknownRecordTypeError
from replay.log import FsyncPolicy, ReplayLog, frame, read_records, segment_header
from replay.records import (
    ActivationRecord,
    Completed,
    ConsumptionRecord,
    DiscardRecord,
    Dropped,
    EngineActivation,
    Errored,
    EvalPrompt,
    EvalRecord,
    PolicyIdentity,
    RolloutRecord,
    RunMetaRecord,
    SamplingSettings,
    Timings,
    decode_record,
    encode_record,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "replay"
# The newest golden segment is what writing must reproduce; every older one (written by an
# earlier record definition, never regenerated) must still read back.
# v2: ActivationRecord gained strategy, kv_policy, kv_carried. v3: SamplingSettings gained
# min_tokens, stop_token_ids, ignore_eos; PolicyIdentity logprobs_mode; ConsumptionRecord the
# trainer's per-rollout and per-step measurements; the DiscardRecord type. v4: PolicyIdentity
# adapter (LoRA runs). v5: RolloutRecord environment_spans (multi-turn episodes). v6: RolloutRecord
# episode_end. v7: RolloutRecord finish_reason (truncations, issue #30).
GOLDEN_SEGMENT = FIXTURES / "golden_v7.seg"
OLDER_GOLDEN_SEGMENTS = [FIXTURES / "golden_v1.seg", FIXTURES / "golden_v2.seg", FIXTURES / "golden_v3.seg",
                         FIXTURES / "golden_v4.seg", FIXTURES / "golden_v5.seg", FIXTURES / "golden_v6.seg"]
IDENTITY = PolicyIdentity("Qwen/Qwen3-0.6B", "tok-1a2b", "tmpl-3c4d", "bf16")

# The on-disk field order. Append new fields (with defaults) at the end; never edit a line.
GOLDEN_FIELDS = {
    RolloutRecord: [
        "rollout_id", "group_id", "prompt_id", "engine_id", "prompt_token_ids",
        "completion_token_ids", "completion_logprobs", "version_starts", "version_values",
        "dispatched_version", "kv_carried_across_versions", "status", "rewards", "sampling",
        "identity", "timings", "consumed_step", "environment_spans", "episode_end",
        "finish_reason",
    ],
    ActivationRecord: ["version", "outcome", "engines", "activated_at", "message", "strategy",
                       "kv_policy", "kv_carried"],
    ConsumptionRecord: ["step", "rollout_ids",
                        "advantages", "log_ratio_mean", "log_ratio_max_abs", "reward_mean", "loss",
                        "version", "metrics"],
    RunMetaRecord: ["run_id", "created_at", "identity", "config"],
    DiscardRecord: ["rollout_ids", "reason", "step", "at"],
    EngineActivation: ["engine_id", "transfer_s", "pause_s", "outcome"],
    SamplingSettings: ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop",
                       "min_tokens", "stop_token_ids", "ignore_eos"],
    PolicyIdentity: ["base_checkpoint", "tokenizer_hash", "chat_template_hash", "serving_precision",
                     "logprobs_mode", "adapter"],
    Timings: ["dispatched_at", "first_token_at", "finished_at"],
    Dropped: ["reason"],
    Errored: ["kind", "message"],
    EvalRecord: ["step", "version", "task", "k", "prompts", "mean_at_k", "pass_at_k", "pass_threshold",
                 "results", "components", "at", "seconds", "versions", "mixed", "due_version", "started_at"],
    EvalPrompt: ["prompt_id", "rewards", "completion_tokens", "errored", "versions"],
}


def rollout(**overrides) -> RolloutRecord:
    arguments = dict(
        rollout_id=17, group_id=4, prompt_id="gsm8k/12", engine_id="engine-1",
        prompt_token_ids=[101, 102, 103], completion_token_ids=[7, 8, 9, 10, 11],
        completion_logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5], dispatched_version=17,
        token_versions=[17, 17, 18, 19, 19], kv_carried_across_versions=True,
        status=Completed(), rewards={"correct": 1.0, "format": 0.5},
        sampling=SamplingSettings(temperature=0.8, top_p=0.95, max_tokens=64, seed=3, stop=("</s>",)),
        identity=IDENTITY, timings=Timings(100.0, 100.25, 101.5), consumed_step=21,
    )
    arguments.update(overrides)
    return RolloutRecord.from_lists(**arguments)


def legacy_golden_records() -> list:
    """What golden_v1 and golden_v2 hold (read with today's defaults for newer fields)."""
    return [
        RunMetaRecord(run_id="golden", created_at=99.5, identity=IDENTITY,
                      config={"max_off_policy_steps": 4}),
        rollout(),
        rollout(rollout_id=18, completion_token_ids=[], completion_logprobs=[], token_versions=None,
                status=Dropped("stale"), rewards={}, consumed_step=None),
        rollout(rollout_id=19, token_versions=None, status=Errored("engine_died", "worker exited"),
                kv_carried_across_versions=False),
        ActivationRecord(version=18, outcome="activated", activated_at=100.1,
                         engines=[EngineActivation("engine-0", 1.25, 0.004),
                                  EngineActivation("engine-1", 1.5, 0.006)]),
        ConsumptionRecord(step=21, rollout_ids=[17, 19]),
    ]


def golden_records() -> list:
    """What the newest golden segment holds: every field set, every record type."""
    nan = float("nan")
    return v6_golden_records() + [
        rollout(rollout_id=26, consumed_step=None, completion_token_ids=[7, 8, 9, 10],
                completion_logprobs=[-0.1, nan, nan, -0.5], token_versions=None,
                version_changes=[(0, 17)], environment_spans=[(1, 3)], episode_end="max_episode_tokens",
                finish_reason="length"),
    ]


def v6_golden_records() -> list:
    """What golden_v6 holds."""
    nan = float("nan")
    return v5_golden_records() + [
        rollout(rollout_id=25, consumed_step=None, completion_token_ids=[7, 8, 9, 10],
                completion_logprobs=[-0.1, nan, nan, -0.5], token_versions=None,
                version_changes=[(0, 17)], environment_spans=[(1, 3)], episode_end="malformed_tool_call"),
    ]


def v5_golden_records() -> list:
    """What golden_v5 holds."""
    nan = float("nan")
    return v4_golden_records() + [
        rollout(rollout_id=24, consumed_step=None, completion_token_ids=[7, 8, 9, 10, 11, 12],
                completion_logprobs=[-0.1, -0.2, nan, nan, -0.5, -0.25], token_versions=None,
                version_changes=[(0, 17), (4, 18)], environment_spans=[(2, 4)]),
    ]


def v4_golden_records() -> list:
    """What golden_v4 holds."""
    return v3_golden_records() + [
        rollout(rollout_id=23, consumed_step=None,
                identity=PolicyIdentity("Qwen/Qwen3-0.6B", "tok-1a2b", "tmpl-3c4d", "bf16",
                                        logprobs_mode="raw_logprobs",
                                        adapter="lora r=16 alpha=32 targets=q_proj,v_proj")),
    ]


def v3_golden_records() -> list:
    """What golden_v3 holds."""
    return legacy_golden_records() + [
        rollout(rollout_id=20, consumed_step=None,
                sampling=SamplingSettings(temperature=0.7, top_k=20, max_tokens=64, min_tokens=2,
                                          stop_token_ids=(2, 7), ignore_eos=True),
                identity=PolicyIdentity("Qwen/Qwen3-0.6B", "tok-1a2b", "tmpl-3c4d", "bf16",
                                        logprobs_mode="processed_logprobs")),
        rollout(rollout_id=21, consumed_step=None, token_versions=None, rewards={"reward": 0.25}),
        ConsumptionRecord.from_arrays(step=22, rollout_ids=[20], advantages=[0.5],
                                      log_ratio_mean=[-0.015625], log_ratio_max_abs=[0.125],
                                      reward_mean=0.75, loss=1.5, version=22,
                                      metrics={"grad_norm": 0.25, "kl": 0.0078125}),
        DiscardRecord(rollout_ids=[21], reason="stale", step=22, at=123.5),
    ]


def write_golden() -> None:
    """Regenerate the golden segment (a deliberate format change only)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        with ReplayLog.open(scratch) as log:
            for record in golden_records():
                log.append(record)
        FIXTURES.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(scratch) / "replay" / "00000001.seg", GOLDEN_SEGMENT)


# --- building and reading back ---------------------------------------------------------------


def test_from_lists_stores_arrays_and_run_length_versions():
    record = rollout()
    assert record.prompt_tokens().tolist() == [101, 102, 103]
    assert record.completion_tokens().dtype == np.int32
    np.testing.assert_allclose(record.logprobs(), [-0.1, -0.2, -0.3, -0.4, -0.5], rtol=1e-6)
    assert record.change_points() == [(0, 17), (2, 18), (3, 19)]
    assert record.expand_versions().tolist() == [17, 17, 18, 19, 19]
    assert record.version_span == (17, 19)
    assert record.status_name == "completed"
    assert len(record.completion_token_ids) == 5 * 4


def test_from_lists_accepts_numpy_arrays_and_change_points():
    record = rollout(completion_token_ids=np.arange(6, dtype=np.int64),
                     completion_logprobs=np.full(6, -1.0), token_versions=None,
                     version_changes=[(0, 17), (4, 20)])
    assert record.expand_versions().tolist() == [17, 17, 17, 17, 20, 20]
    assert record.num_completion_tokens == 6


def test_an_empty_completion_spans_its_dispatched_version():
    record = rollout(completion_token_ids=[], completion_logprobs=[], token_versions=None)
    assert record.change_points() == []
    assert record.expand_versions().tolist() == []
    assert record.version_span == (17, 17)


def test_every_record_type_round_trips_through_bytes():
    for record in golden_records():
        assert decode_record(encode_record(record)) == record


# --- refusing bad records on write -----------------------------------------------------------


@pytest.mark.parametrize("make, field", [
    (lambda: msgspec.structs.replace(rollout(), rollout_id="seventeen"), "rollout_id"),
    (lambda: msgspec.structs.replace(rollout(), rollout_id=np.int64(17)), "rollout_id"),
    (lambda: msgspec.structs.replace(rollout(), engine_id=1), "engine_id"),
    (lambda: msgspec.structs.replace(rollout(), sampling=SamplingSettings(temperature="hot")),
     "sampling.temperature"),
    (lambda: msgspec.structs.replace(rollout(), status=Dropped(reason=3)), "status.reason"),
    (lambda: msgspec.structs.replace(rollout(), consumed_step=2.5), "consumed_step"),
    (lambda: msgspec.structs.replace(rollout(), rewards={"correct": "yes"}), "rewards"),
    (lambda: ConsumptionRecord(step=3, rollout_ids=["a"]), "rollout_ids"),
])
def test_wrong_types_are_refused_on_write_naming_the_field(tmp_path, make, field):
    record = make()
    with pytest.raises(InvalidRecordError) as raised:
        encode_record(record)
    assert raised.value.field.startswith(field)
    with ReplayLog.open(tmp_path) as log, pytest.raises(InvalidRecordError) as raised:
        log.append(record)
    assert raised.value.field.startswith(field)
    assert f"`{raised.value.field}`" in str(raised.value)
    assert list(read_records(tmp_path)) == []


@pytest.mark.parametrize("overrides, field", [
    ({"completion_logprobs": [-0.1, math.nan, -0.3, -0.4, -0.5]}, "completion_logprobs"),
    ({"completion_logprobs": [-0.1, -0.2, math.inf, -0.4, -0.5]}, "completion_logprobs"),
    ({"completion_logprobs": [-0.1, -0.2]}, "completion_logprobs"),
    ({"token_versions": [17, 18, 17, 19, 19]}, "version_values"),
    ({"token_versions": None, "version_changes": [(0, 19), (3, 18)]}, "version_values"),
    ({"token_versions": None, "version_changes": [(0, 17), (0, 18)]}, "version_starts"),
    ({"token_versions": None, "version_changes": [(1, 17)]}, "version_starts"),
    ({"token_versions": None, "version_changes": [(0, 17), (5, 18)]}, "version_starts"),
    ({"token_versions": [16, 16, 17, 17, 17]}, "version_values"),  # older than dispatched
    ({"rewards": {"correct": math.nan}}, "rewards.correct"),
])
def test_broken_invariants_are_refused_when_built(overrides, field):
    with pytest.raises(InvalidRecordError) as raised:
        rollout(**overrides)
    assert raised.value.field == field


def test_blobs_given_as_lists_are_refused_with_a_hint():
    with pytest.raises(InvalidRecordError, match="from_lists") as raised:
        msgspec.structs.replace(rollout(), completion_token_ids=[7, 8, 9, 10, 11])
    assert raised.value.field == "completion_token_ids"
    with pytest.raises(InvalidRecordError, match="multiple of 4") as raised:
        msgspec.structs.replace(rollout(), prompt_token_ids=b"\x01\x02")
    assert raised.value.field == "prompt_token_ids"


def test_a_nan_put_into_rewards_after_building_is_refused_on_write(tmp_path):
    record = rollout()
    record.rewards["format"] = math.nan  # the dict inside a frozen record is still mutable
    with ReplayLog.open(tmp_path) as log, pytest.raises(InvalidRecordError) as raised:
        log.append(record)
    assert raised.value.field == "rewards.format"


def test_negative_activation_durations_are_refused():
    with pytest.raises(InvalidRecordError) as raised:
        ActivationRecord(version=3, outcome="activated", engines=[EngineActivation("e0", 1.0, -0.5)])
    assert raised.value.field == "engines[0].pause_s"


def test_the_invariants_are_checked_again_on_read():
    good = msgspec.to_builtins(rollout())
    good.update(completion_logprobs=rollout().completion_logprobs[:8],
                prompt_token_ids=rollout().prompt_token_ids,
                completion_token_ids=rollout().completion_token_ids,
                version_starts=rollout().version_starts, version_values=rollout().version_values,
                environment_spans=rollout().environment_spans)
    with pytest.raises(InvalidRecordError) as raised:
        decode_record(msgspec.msgpack.encode(good))
    assert raised.value.field == "completion_logprobs"


# --- the on-disk format is stable ------------------------------------------------------------


@pytest.mark.parametrize("struct_type", list(GOLDEN_FIELDS))
def test_field_order_matches_the_golden_list(struct_type):
    assert list(struct_type.__struct_fields__) == GOLDEN_FIELDS[struct_type]


def test_new_fields_have_defaults_so_old_logs_still_read():
    """Every field after the first version's fields must have a default."""
    first_version_required = {RolloutRecord: 16, ActivationRecord: 3, ConsumptionRecord: 2,
                              RunMetaRecord: 2, DiscardRecord: 2, SamplingSettings: 0,
                              PolicyIdentity: 4}
    for struct_type, required in first_version_required.items():
        for info in msgspec.structs.fields(struct_type)[required:]:
            has_default = (info.default is not msgspec.NODEFAULT
                           or info.default_factory is not msgspec.NODEFAULT)
            assert has_default, f"{struct_type.__name__}.{info.name} needs a default"


def test_writing_golden_records_reproduces_the_golden_segment_bytes(tmp_path):
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.always()) as log:
        for record in golden_records():
            log.append(record)
    written = (tmp_path / "replay" / "00000001.seg").read_bytes()
    golden = GOLDEN_SEGMENT.read_bytes()
    assert written == golden


@pytest.mark.parametrize("segment", [GOLDEN_SEGMENT, *OLDER_GOLDEN_SEGMENTS], ids=lambda p: p.name)
def test_every_golden_segment_reads_back_as_the_golden_records(tmp_path, segment):
    (tmp_path / "replay").mkdir()
    shutil.copy(segment, tmp_path / "replay" / "00000001.seg")
    expected = {GOLDEN_SEGMENT: golden_records, FIXTURES / "golden_v3.seg": v3_golden_records,
                FIXTURES / "golden_v4.seg": v4_golden_records,
                FIXTURES / "golden_v5.seg": v5_golden_records,
                FIXTURES / "golden_v6.seg": v6_golden_records}.get(
        segment, legacy_golden_records)()
    assert list(read_records(tmp_path)) == expected


def _definition(struct_type: type, fields: list) -> type:
    config = struct_type.__struct_config__
    return msgspec.defstruct(f"{struct_type.__name__}Variant", fields, tag=config.tag,
                             tag_field=config.tag_field, frozen=True)


def _current_fields(struct_type: type) -> list:
    fields = []
    for info in msgspec.structs.fields(struct_type):
        if info.default is not msgspec.NODEFAULT:
            fields.append((info.name, info.type, info.default))
        elif info.default_factory is not msgspec.NODEFAULT:
            fields.append((info.name, info.type, msgspec.field(default_factory=info.default_factory)))
        else:
            fields.append((info.name, info.type))
    return fields


def test_a_log_written_with_the_previous_definition_reads_with_the_current_one(tmp_path):
    previous = _definition(RolloutRecord, _current_fields(RolloutRecord)[:-1])  # no consumed_step
    current = rollout(consumed_step=None)
    old = previous(**{name: getattr(current, name) for name in previous.__struct_fields__})
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "00000001.seg").write_bytes(
        segment_header(1) + frame(msgspec.msgpack.encode(old)))
    assert list(read_records(tmp_path)) == [current]


def test_a_log_written_with_the_current_definition_reads_with_the_previous_one(tmp_path):
    previous = _definition(RolloutRecord, _current_fields(RolloutRecord)[:-1])
    record = rollout()
    decoded = msgspec.msgpack.decode(encode_record(record), type=previous)
    assert decoded.rollout_id == record.rollout_id
    assert decoded.completion_logprobs == record.completion_logprobs
    assert not hasattr(decoded, "finish_reason")


def test_a_next_definition_with_an_appended_field_interoperates_both_ways(tmp_path):
    following = _definition(RolloutRecord, _current_fields(RolloutRecord) + [("engine_step", int, -1)])
    record = rollout()
    newer = msgspec.msgpack.decode(encode_record(record), type=following)
    assert newer.engine_step == -1  # the default fills in what the current writer did not write
    newer = msgspec.structs.replace(newer, engine_step=5)
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "00000001.seg").write_bytes(
        segment_header(1) + frame(msgspec.msgpack.encode(newer)))
    assert list(read_records(tmp_path)) == [record]  # the current reader skips engine_step


# --- sampling settings: one type for the engine and the log ----------------------------------


def test_sampling_settings_validate_returns_itself_and_maps_onto_vllm():
    settings = SamplingSettings(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=64,
                                seed=3, stop=("</s>",), min_tokens=2, stop_token_ids=(2, 7),
                                ignore_eos=True)
    assert settings.validate() is settings
    assert settings.to_vllm() == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_tokens": 64,
        "min_tokens": 2, "seed": 3, "stop": ["</s>"], "stop_token_ids": [2, 7],
        "ignore_eos": True, "logprobs": 0,
    }
    unbounded = SamplingSettings().validate().to_vllm()
    assert "max_tokens" not in unbounded  # None is left to vLLM, never invented
    assert unbounded["seed"] is None and unbounded["top_k"] == -1


@pytest.mark.parametrize("overrides, field", [
    ({"temperature": -0.1}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"temperature": math.inf}, "sampling.temperature"),
    ({"temperature": "hot"}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"top_k": -2}, "sampling.top_k"),
    ({"top_k": 1.5}, "sampling.top_k"),
    ({"min_p": -0.5}, "sampling.min_p"),
    ({"min_p": 1.5}, "sampling.min_p"),
    ({"max_tokens": 0}, "sampling.max_tokens"),
    ({"min_tokens": -1}, "sampling.min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "sampling.min_tokens"),
    ({"seed": -1}, "sampling.seed"),
    ({"stop_token_ids": (3, -1)}, "sampling.stop_token_ids[1]"),
    ({"ignore_eos": 1}, "sampling.ignore_eos"),
])
def test_sampling_settings_out_of_range_are_refused_naming_the_field(overrides, field):
    with pytest.raises(InvalidRecordError) as raised:
        SamplingSettings(**overrides).validate()
    assert raised.value.field == field
    assert f"`{field}`" in str(raised.value)


@pytest.mark.parametrize("settings", [SamplingSettings(top_k=0), SamplingSettings(top_k=-1),
                                      SamplingSettings(temperature=0.0, min_tokens=4, max_tokens=4),
                                      SamplingSettings(min_tokens=100)])
def test_sampling_settings_edges_that_are_valid(settings):
    assert settings.validate() is settings


# --- consumption and discard records ---------------------------------------------------------


def test_consumption_record_carries_per_rollout_values_aligned_with_ids():
    record = ConsumptionRecord.from_arrays(step=4, rollout_ids=np.array([7, 8, 9]),
                                           advantages=[1.0, -0.5, 0.0], loss=0.25, version=4)
    assert record.rollout_ids == [7, 8, 9]
    assert record.values("advantages").tolist() == [1.0, -0.5, 0.0]
    assert record.values("log_ratio_mean") is None  # not recorded: absent, never 0.0
    assert record.reward_mean is None and record.metrics == {}
    assert decode_record(encode_record(record)) == record
    with pytest.raises(KeyError):
        record.values("loss")


@pytest.mark.parametrize("make, field", [
    (lambda: ConsumptionRecord.from_arrays(step=1, rollout_ids=[1, 2], advantages=[1.0]), "advantages"),
    (lambda: ConsumptionRecord.from_arrays(step=1, rollout_ids=[1], log_ratio_mean=[math.nan]),
     "log_ratio_mean"),
    (lambda: ConsumptionRecord(step=1, rollout_ids=[1], log_ratio_max_abs=b"\x00\x00"), "log_ratio_max_abs"),
    (lambda: ConsumptionRecord(step=1, rollout_ids=[1], loss=math.nan), "loss"),
    (lambda: ConsumptionRecord(step=1, rollout_ids=[1], reward_mean=math.nan), "reward_mean"),
    (lambda: ConsumptionRecord(step=1, rollout_ids=[1], metrics={"kl": math.nan}), "metrics.kl"),
    (lambda: ConsumptionRecord(step=1, rollout_ids=[1], version=-1), "version"),
    (lambda: DiscardRecord(rollout_ids=[1], reason="stale", step=-2), "step"),
])
def test_bad_consumption_and_discard_records_are_refused(make, field):
    with pytest.raises(InvalidRecordError) as raised:
        make()
    assert raised.value.field == field


def test_a_consumption_record_changed_after_building_is_refused_on_write(tmp_path):
    record = ConsumptionRecord.from_arrays(step=1, rollout_ids=[1], advantages=[0.5])
    record.rollout_ids.append(2)  # the list inside a frozen record is still mutable
    with ReplayLog.open(tmp_path) as log, pytest.raises(InvalidRecordError) as raised:
        log.append(record)
    assert raised.value.field == "advantages"
    other = ConsumptionRecord(step=1, rollout_ids=[1])
    other.metrics["loss_scale"] = math.nan
    with pytest.raises(InvalidRecordError) as raised:
        encode_record(other)
    assert raised.value.field == "metrics.loss_scale"


def test_an_invalid_consumption_record_is_refused_on_read():
    good = msgspec.to_builtins(ConsumptionRecord(step=1, rollout_ids=[1, 2]))
    good.update(log_ratio_mean=b"", log_ratio_max_abs=b"")  # (to_builtins made them text)
    good["advantages"] = struct.pack("<f", 1.0)  # one value for two rollouts
    with pytest.raises(InvalidRecordError) as raised:
        decode_record(msgspec.msgpack.encode(good))
    assert raised.value.field == "advantages"


# --- record types from a newer writer --------------------------------------------------------


def test_an_unknown_record_type_is_named_as_such():
    with pytest.raises(UnknownRecordTypeError) as raised:
        decode_record(msgspec.msgpack.encode({"type": "future_thing", "payload": [1, 2]}))
    assert raised.value.record_type == "future_thing" and raised.value.field == "type"
    assert isinstance(raised.value.at("00000001.seg", 16), UnknownRecordTypeError)
    for not_unknown in ({"type": 3}, {"rollout_id": 1}, [1, 2],
                        {"type": "consumption", "step": "x", "rollout_ids": []}):
        with pytest.raises(InvalidRecordError) as raised:
            decode_record(msgspec.msgpack.encode(not_unknown))
        assert not isinstance(raised.value, UnknownRecordTypeError), not_unknown


@pytest.mark.parametrize("spans,logprobs,field,why", [
    ([(2, 4)], [-0.1, -0.2, -0.3, float("nan"), -0.5], "completion_logprobs", "which the environment wrote"),
    ([(2, 4)], [-0.1, float("nan"), float("nan"), float("nan"), -0.5], "completion_logprobs", "sampled token 1"),
    ([(3, 2)], [-0.1] * 5, "environment_spans[0]", "not a non-empty range"),
    ([(1, 2), (2, 3)], [-0.1, float("nan"), float("nan"), -0.1, -0.1], "environment_spans[1]", "adjacent"),
    ([(4, 6)], [-0.1] * 5, "environment_spans[0]", "within the 5"),
])
def test_an_episode_record_keeps_nan_exactly_where_the_environment_wrote(spans, logprobs, field, why):
    with pytest.raises(InvalidRecordError) as raised:
        rollout(completion_logprobs=logprobs, environment_spans=spans)
    assert raised.value.field == field and why in str(raised.value)


def test_an_episode_reports_its_turns_and_which_tokens_were_sampled():
    nan = float("nan")
    r = rollout(completion_logprobs=[-0.1, nan, nan, -0.4, -0.5], environment_spans=[(1, 3)])
    assert r.turns == 2 and r.environment_ranges() == [(1, 3)]
    assert r.sampled_mask().tolist() == [True, False, False, True, True]
    assert rollout().turns == 1 and rollout().sampled_mask().all()
    assert rollout(completion_token_ids=[], completion_logprobs=[], token_versions=None).turns == 0

