"""`stats_from_log`: the statistics of a log on disk, segment by segment, each segment read
from its sidecar summary when one matches it exactly, else scanned (and a sidecar written)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from replay.log import FileSystem, LogReader
from replay.query.columns import ColumnBuilder
from replay.query.sidecars import (
    SegmentKey,
    find_sidecars,
    load_sidecar,
    summarize_segment,
    write_sidecar,
)
from replay.query.stats import Filters, compute_stats
from replay.records import Record


def log_section(*, directory: str, records: int, corrupt_records: int = 0,
                invalid_records: int = 0, torn_tail_bytes: int = 0, unknown_records: int = 0,
                missing_segments: int = 0) -> dict[str, Any]:
    """The `log` section of the statistics, keys in their fixed order."""
    return {
        "directory": directory,
        "records": records,
        "corrupt_records": corrupt_records,
        "invalid_records": invalid_records,
        "torn_tail_bytes": torn_tail_bytes,
        "unknown_records": unknown_records,
        "missing_segments": missing_segments,
    }


def stats_from_log(run_dir: str | os.PathLike[str], filters: Filters | None = None, *,
                   lenient: bool = False, fs: FileSystem | None = None,
                   on_record: Callable[[], None] | None = None,
                   sidecars: bool = True) -> dict[str, Any]:
    """Summarize a log, segment by segment. Raises CorruptRecordError (a corrupt frame, a
    missing segment) / InvalidRecordError unless `lenient`. `on_record` is called per record
    scanned (progress display).

    A segment whose sidecar matches its exact size and SHA-256 is read from the sidecar: it is
    then exactly what was summarized when every record in it passed verification. Any other
    segment is scanned (every frame verified, every record decoded and validated) and, if it
    held no corrupt or invalid record and no torn tail, gets a new sidecar. `sidecars=False`
    (`--verify`) scans every segment.
    """
    reader = LogReader(run_dir, lenient=lenient, fs=fs)
    found = find_sidecars(reader.fs, reader.log_dir)
    builder = ColumnBuilder()
    records = 0
    for segment, is_last, data, key in _read_ahead(reader, digests=sidecars):
        try:
            summary = (load_sidecar(reader.fs, reader.log_dir, key, found.get(segment, []))
                       if sidecars else None)
            if summary is None:
                problems = (reader.corrupt_records, reader.invalid_records, reader.torn_tail_bytes)
                unknown = reader.unknown_records
                summary = summarize_segment(_counted(reader.segment_records(segment, is_last, data),
                                                     on_record))
                summary.unknown_records = reader.unknown_records - unknown
                if problems == (reader.corrupt_records, reader.invalid_records, reader.torn_tail_bytes):
                    write_sidecar(reader.fs, reader.log_dir, key, summary, found.get(segment, []))
            else:
                reader.unknown_records += summary.unknown_records
            builder.add_summary(summary)
            records += summary.records
        finally:
            reader.release_segment(data)
    stats = compute_stats(builder.build(), filters)
    stats["log"] = log_section(
        directory=reader.log_dir, records=records, corrupt_records=reader.corrupt_records,
        invalid_records=reader.invalid_records, torn_tail_bytes=reader.torn_tail_bytes,
        unknown_records=reader.unknown_records, missing_segments=reader.missing_segments)
    fleet = fleet_history(run_dir)
    if fleet is not None:
        stats["fleet"] = fleet
    return stats


FLEET_LOG = "fleet.jsonl"  # written by the run (orchestrator/run/fleet_keeper.py): one line per change


def fleet_history(run_dir: str | os.PathLike[str]) -> list[dict] | None:
    """The run's engines joining, draining, lost and replaced over time (RUN_DIR/fleet.jsonl),
    one entry per change of an engine's state; None for a run without the file. A torn last
    line (the run died mid-write) is skipped."""
    import json

    path = os.path.join(os.fspath(run_dir), FLEET_LOG)
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _read_ahead(reader: LogReader, *, digests: bool) -> Iterator[tuple[str, bool, bytes, SegmentKey]]:
    """(segment, is newest, bytes, key) of every segment in order. The next segment is read
    (and hashed: hashlib and file reads release the GIL) on a helper thread while this one is
    summarized. Reading checks that no segment is missing before it."""
    def load(segment: str) -> tuple[bytes, SegmentKey]:
        data = reader.read_segment(segment)
        key = SegmentKey(segment, data)
        if digests:
            key.digest  # noqa: B018 - computed here, off the main thread
        return data, key

    segments = reader.segments()
    if not segments:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="replay-read-ahead") as pool:
        future = pool.submit(load, segments[0][0])
        for i, (segment, is_last) in enumerate(segments):
            data, key = future.result()
            if i + 1 < len(segments):
                future = pool.submit(load, segments[i + 1][0])
            yield segment, is_last, data, key


def _counted(records: Iterator[Record], on_record: Callable[[], None] | None) -> Iterator[Record]:
    if on_record is None:
        return records
    return _each_counted(records, on_record)


def _each_counted(records: Iterator[Record], on_record: Callable[[], None]) -> Iterator[Record]:
    for record in records:
        on_record()
        yield record
