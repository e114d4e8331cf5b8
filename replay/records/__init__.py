"""Replay records: what the log stores, as msgspec Structs.

One log holds a tagged union of record types (the msgpack map key ``"type"`` names the type):

    rollout      RolloutRecord     one terminal record per dispatched rollout
    activation   ActivationRecord  one per attempted activation of a policy version
    consumption  ConsumptionRecord which rollouts a trainer step consumed (and what it measured)
    discard      DiscardRecord     completed rollouts that no trainer step will consume
    run_meta     RunMetaRecord     run identity and configuration
    eval         EvalRecord        a held-out evaluation, labelled with its tokens' versions (never trained on)

A reader meets record types it does not know when a newer writer wrote the log:
`decode_record` raises `UnknownRecordTypeError` for them, and the log readers skip and count
them (`unknown_records`) rather than fail.

Rules for evolving these definitions (tests/unit/test_replay_records.py enforces them with a
golden list of field names and golden encoded bytes):

* append new fields at the end, always with a default; never reorder, rename or remove;
* records are msgpack maps keyed by field name, so an old reader skips fields it does not
  know and a new reader fills in defaults for fields an old writer did not write.

Token ids and logprobs are little-endian int32 / float32 byte blobs: msgspec copies a blob
in well under a microsecond, while decoding a 700-element Python list costs ~25x more.
A rollout's per-token policy versions are stored as run-length change points: token index
``version_starts[i]`` is the first token sampled under ``version_values[i]``.

Invariants (equal lengths, versions never decreasing, no NaN logprob) are checked in
``__post_init__``, which msgspec runs both when a record is built and when one is decoded,
so every write and every read checks them. Field types are checked on write by
``encode_record`` / ``encode_record_into`` / ``encode_record_to`` (the log's: into a reused
scratch buffer), each decoding the encoded bytes once against the record's shape, and on
read by the typed decoder.

Modules: `parts` (status, sampling settings, identity, timings, reason strings), `types` (the
top-level records), `checks` (invariants, blob helpers), `codec` (encode/decode); every name
is importable from `replay.records`.
"""

from replay.records.checks import FLOAT32, INT32, int32_values
from replay.records.codec import (
    decode_record,
    encode_record,
    encode_record_into,
    encode_record_to,
)
from replay.records.parts import (
    ACTIVATED,
    COMPLETED,
    DEFAULT_SAMPLING,
    DISCARD_GROUP_FAILED,
    DISCARD_SHUTDOWN,
    DISCARD_STALE,
    DISCARD_TRAINER_LOST,
    DROP_ABORTED,
    DROP_GROUP_FAILED,
    DROP_SHUTDOWN,
    DROP_STALE,
    ENGINE_FENCED,
    FINISH_LENGTH,
    ROLLED_BACK,
    STATUS_NAMES,
    Completed,
    Dropped,
    EngineActivation,
    Errored,
    PolicyIdentity,
    SamplingSettings,
    Status,
    Timings,
)
from replay.records.types import (
    RECORD_TAGS,
    RECORD_TYPES,
    ActivationRecord,
    ConsumptionRecord,
    DiscardRecord,
    EvalPrompt,
    EvalRecord,
    Record,
    RolloutRecord,
    RunMetaRecord,
    make_rollout,
)

__all__ = [
    "ACTIVATED", "COMPLETED", "DEFAULT_SAMPLING", "DISCARD_GROUP_FAILED", "DISCARD_SHUTDOWN",
    "DISCARD_STALE", "DISCARD_TRAINER_LOST", "DROP_ABORTED", "DROP_GROUP_FAILED", "DROP_SHUTDOWN",
    "DROP_STALE", "ENGINE_FENCED", "FINISH_LENGTH", "FLOAT32", "INT32", "RECORD_TAGS", "RECORD_TYPES", "ROLLED_BACK",
    "STATUS_NAMES", "ActivationRecord", "Completed", "ConsumptionRecord", "DiscardRecord", "EvalPrompt", "EvalRecord",
    "Dropped", "EngineActivation", "Errored", "PolicyIdentity", "Record", "RolloutRecord",
    "RunMetaRecord", "SamplingSettings", "Status", "Timings", "decode_record", "encode_record",
    "encode_record_into", "encode_record_to", "int32_values", "make_rollout",
]
