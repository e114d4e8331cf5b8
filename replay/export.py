"""Export a replay log to Parquet: one row per rollout, optionally one row per token.

Written with pyarrow in row groups as the log is scanned, so memory stays bounded; the files
read back with DuckDB (`SELECT * FROM 'out.parquet'`), polars (`pl.read_parquet`) or pandas.
What happened to each rollout after generation (consumed by a trainer step, with its
advantage and log-ratio statistics, or discarded) follows the one rule of
`replay.query.ledger` (the first claim in log order wins), as `inflight stats` does; claims may
come after the rollout record, so the log is read twice: once (cheaply) for the claims, once
for the rows.

Staleness is (s - 1) - dispatched version for a rollout consumed by trainer step s, and a
token's lag (s - 1) - its version (see replay.query).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.errors import InvalidRecordError
from replay.log import FileSystem, LogReader
from replay.query.ledger import CONSUMED, DISCARDED, Claim, Ledger, claims_of
from replay.records import (
    INT32,
    ConsumptionRecord,
    DiscardRecord,
    Dropped,
    Errored,
    RolloutRecord,
    decode_record,
)

ROLLOUT_SCHEMA = pa.schema([
    ("rollout_id", pa.int64()),
    ("group_id", pa.int64()),
    ("prompt_id", pa.string()),
    ("engine_id", pa.string()),
    ("status", pa.string()),
    ("drop_reason", pa.string()),
    ("error_kind", pa.string()),
    ("error_message", pa.string()),
    ("dispatched_version", pa.int64()),
    ("span_start", pa.int64()),
    ("span_end", pa.int64()),
    ("n_versions", pa.int32()),
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("kv_carried_across_versions", pa.bool_()),
    ("consumed_step", pa.int64()),
    ("staleness", pa.int64()),
    ("rewards", pa.map_(pa.string(), pa.float64())),
    ("temperature", pa.float64()),
    ("top_p", pa.float64()),
    ("top_k", pa.int64()),
    ("min_p", pa.float64()),
    ("max_tokens", pa.int64()),
    ("seed", pa.int64()),
    ("base_checkpoint", pa.string()),
    ("tokenizer_hash", pa.string()),
    ("chat_template_hash", pa.string()),
    ("serving_precision", pa.string()),
    ("dispatched_at", pa.float64()),
    ("first_token_at", pa.float64()),
    ("finished_at", pa.float64()),
    ("segment", pa.string()),
    ("offset", pa.int64()),
    # appended later (new columns go at the end)
    ("min_tokens", pa.int64()),
    ("stop_token_ids", pa.list_(pa.int64())),
    ("ignore_eos", pa.bool_()),
    ("logprobs_mode", pa.string()),
    ("in_flight_lag", pa.int64()),
    ("queue_lag", pa.int64()),
    ("advantage", pa.float32()),
    ("log_ratio_mean", pa.float32()),
    ("log_ratio_max_abs", pa.float32()),
    ("discard_reason", pa.string()),
    ("discard_step", pa.int64()),
])

TOKEN_SCHEMA = pa.schema([
    ("rollout_id", pa.int64()),
    ("position", pa.int32()),
    ("token_id", pa.int32()),
    ("logprob", pa.float32()),
    ("version", pa.int32()),
    ("lag", pa.int64()),  # (consuming step - 1) - version; null when no step consumed the rollout
])


class ExportResult(msgspec.Struct):
    rollouts: int
    tokens: int
    corrupt_records: int
    invalid_records: int
    unknown_records: int = 0
    missing_segments: int = 0
    invalid_consumptions: int = 0


class _Probe(msgspec.Struct):
    """Decodes just enough of any record to find claims (blobs are skipped, not copied)."""

    type: str
    rollout_id: int | None = None
    consumed_step: int | None = None


def default_tokens_path(out: str | os.PathLike[str]) -> str:
    stem, _ = os.path.splitext(os.fspath(out))
    return f"{stem}.tokens.parquet"


def export_parquet(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
                   tokens_out: str | os.PathLike[str] | None = None, lenient: bool = False,
                   batch_rollouts: int = 4096, fs: FileSystem | None = None,
                   on_record: Callable[[], None] | None = None) -> ExportResult:
    decided, invalid_consumptions = _claims(run_dir, lenient, fs)
    reader = LogReader(run_dir, lenient=lenient, fs=fs)
    rollout_writer = pq.ParquetWriter(os.fspath(out), ROLLOUT_SCHEMA)
    token_writer = pq.ParquetWriter(os.fspath(tokens_out), TOKEN_SCHEMA) if tokens_out else None
    n_rollouts = n_tokens = 0
    batch: list[tuple[str, int, RolloutRecord]] = []

    def flush() -> None:
        nonlocal n_tokens
        rows = [_rollout_row(seg, off, rec, decided.get(rec.rollout_id)) for seg, off, rec in batch]
        rollout_writer.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA))
        if token_writer is not None:
            table = _token_table([rec for _, _, rec in batch], decided)
            token_writer.write_table(table)
            n_tokens += table.num_rows
        batch.clear()

    try:
        for located in reader.located():
            if on_record is not None:
                on_record()
            if isinstance(located.record, RolloutRecord):
                batch.append((located.segment, located.offset, located.record))
                n_rollouts += 1
                if len(batch) >= batch_rollouts:
                    flush()
        if batch or n_rollouts == 0:
            flush()
    finally:
        rollout_writer.close()
        if token_writer is not None:
            token_writer.close()
    return ExportResult(n_rollouts, n_tokens, reader.corrupt_records, reader.invalid_records,
                        reader.unknown_records, reader.missing_segments, invalid_consumptions)


def _claims(run_dir: str | os.PathLike[str], lenient: bool,
            fs: FileSystem | None) -> tuple[dict[int, Claim | None], int]:
    """rollout id -> the claim that decided it (None: seen, never claimed), and the number of
    invalid consumptions, from one pass in log order (checksums verified). Records the second
    pass refuses as invalid are left out here too: consumption and discard records, and
    rollouts that carry their own consumed_step, are decoded in full; other rollouts claim
    nothing, so their ids are enough."""
    probe = msgspec.msgpack.Decoder(_Probe)
    ledger = Ledger()
    decided: dict[int, Claim | None] = {}
    for _, _, payload in LogReader(run_dir, lenient=lenient, fs=fs).frames():
        try:
            head = probe.decode(payload)
        except msgspec.MsgspecError:
            continue  # the second pass reports (or counts) this record
        if head.type == "rollout" and head.consumed_step is None:
            if head.rollout_id is not None:
                _arrive(ledger, decided, head.rollout_id, None)
            continue
        if head.type not in ("rollout", "consumption", "discard"):
            continue
        try:
            record = decode_record(payload)
        except InvalidRecordError:
            continue  # the second pass reports (or counts) it
        if isinstance(record, RolloutRecord):
            _arrive(ledger, decided, record.rollout_id, record.consumed_step)
        elif isinstance(record, ConsumptionRecord | DiscardRecord):
            for rollout_id, claim in claims_of(record):
                state = decided.get(rollout_id, _UNSEEN)
                if ledger.claim(rollout_id, claim, None if state is _UNSEEN else state is not None):
                    decided[rollout_id] = claim
    return decided, ledger.invalid


_UNSEEN: Final = Claim("", None)


def _arrive(ledger: Ledger, decided: dict[int, Claim | None], rollout_id: int,
            consumed_step: int | None) -> None:
    claim = ledger.arrive(rollout_id, consumed_step)
    if decided.get(rollout_id) is None:  # (a second record of one rollout keeps a decision)
        decided[rollout_id] = claim


def _consumed_step(claim: Claim | None) -> int | None:
    return claim.step if claim is not None and claim.kind == CONSUMED else None


def _per_rollout(claim: Claim | None, name: str) -> float | None:
    """The deciding consumption record's value for this rollout, if it recorded one."""
    if claim is None or claim.kind != CONSUMED or not isinstance(claim.record, ConsumptionRecord):
        return None
    values = claim.record.values(name)
    return None if values is None else float(values[claim.index])


def _rollout_row(segment: str, offset: int, rec: RolloutRecord,
                 claim: Claim | None) -> dict[str, Any]:
    step = _consumed_step(claim)
    first, last = rec.version_span
    status = rec.status
    staleness = None if step is None else (step - 1) - rec.dispatched_version
    discard = claim if claim is not None and claim.kind == DISCARDED else None
    return {
        "rollout_id": rec.rollout_id,
        "group_id": rec.group_id,
        "prompt_id": rec.prompt_id,
        "engine_id": rec.engine_id,
        "status": rec.status_name,
        "drop_reason": status.reason if isinstance(status, Dropped) else None,
        "error_kind": status.kind if isinstance(status, Errored) else None,
        "error_message": status.message if isinstance(status, Errored) else None,
        "dispatched_version": rec.dispatched_version,
        "span_start": first,
        "span_end": last,
        "n_versions": len(rec.version_values) // 4,
        "prompt_tokens": len(rec.prompt_token_ids) // 4,
        "completion_tokens": rec.num_completion_tokens,
        "kv_carried_across_versions": rec.kv_carried_across_versions,
        "consumed_step": step,
        "staleness": staleness,
        "rewards": list(rec.rewards.items()),
        "temperature": rec.sampling.temperature,
        "top_p": rec.sampling.top_p,
        "top_k": rec.sampling.top_k,
        "min_p": rec.sampling.min_p,
        "max_tokens": rec.sampling.max_tokens,
        "seed": rec.sampling.seed,
        "base_checkpoint": rec.identity.base_checkpoint,
        "tokenizer_hash": rec.identity.tokenizer_hash,
        "chat_template_hash": rec.identity.chat_template_hash,
        "serving_precision": rec.identity.serving_precision,
        "dispatched_at": rec.timings.dispatched_at,
        "first_token_at": rec.timings.first_token_at,
        "finished_at": rec.timings.finished_at,
        "segment": segment,
        "offset": offset,
        "min_tokens": rec.sampling.min_tokens,
        "stop_token_ids": list(rec.sampling.stop_token_ids),
        "ignore_eos": rec.sampling.ignore_eos,
        "logprobs_mode": rec.identity.logprobs_mode,
        "in_flight_lag": None if step is None else last - first,
        "queue_lag": None if staleness is None else staleness - (last - first),
        "advantage": _per_rollout(claim, "advantages"),
        "log_ratio_mean": _per_rollout(claim, "log_ratio_mean"),
        "log_ratio_max_abs": _per_rollout(claim, "log_ratio_max_abs"),
        "discard_reason": None if discard is None else discard.reason,
        "discard_step": None if discard is None else discard.step,
    }


def _token_table(records: list[RolloutRecord], decided: dict[int, Claim | None]) -> pa.Table:
    counts = np.array([rec.num_completion_tokens for rec in records], dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return TOKEN_SCHEMA.empty_table()
    rollout_ids = np.repeat([rec.rollout_id for rec in records], counts)
    positions = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    token_ids = np.frombuffer(b"".join(rec.completion_token_ids for rec in records), INT32)
    logprobs = np.concatenate([rec.logprobs() for rec in records])
    versions = np.concatenate([rec.expand_versions() for rec in records])
    steps = np.repeat([_or_minus_one(_consumed_step(decided.get(rec.rollout_id))) for rec in records],
                      counts)
    lag = pa.array((steps - 1) - versions, mask=steps < 0)
    return pa.table({
        "rollout_id": pa.array(rollout_ids, pa.int64()),
        "position": pa.array(positions.astype(np.int32)),
        "token_id": pa.array(token_ids),
        "logprob": pa.array(logprobs, mask=np.isnan(logprobs)),  # null: an environment's token, never sampled
        "version": pa.array(versions),
        "lag": lag.cast(pa.int64()),
    }, schema=TOKEN_SCHEMA)


def _or_minus_one(step: int | None) -> int:
    return -1 if step is None else step
