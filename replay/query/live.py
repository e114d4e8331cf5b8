"""Live statistics: what the orchestrator's `/stats` serves while the log is being written."""

from __future__ import annotations

import threading
from typing import Any

from replay.query.columns import ColumnBuilder
from replay.query.fromlog import log_section
from replay.query.stats import Filters, compute_stats
from replay.records import Record


class LiveStats:
    """Feed it every record appended to the log (`add`, O(1) amortised, no token blobs kept);
    `snapshot` returns exactly what `stats_from_log(run_dir, filters)` returns for the same
    records. Thread-safe: records may be added by the log's writer thread while a request
    handler takes a snapshot.

    The `log` section describes files this object never reads, so the caller supplies it:
    `log_info` holds `directory` and any of `records`, `corrupt_records`, `invalid_records`,
    `torn_tail_bytes`, `unknown_records`, `missing_segments` (`records` defaults to the number
    of records added, the others to 0: a log being written has none).
    """

    def __init__(self) -> None:
        self._builder = ColumnBuilder()
        self._records = 0
        self._lock = threading.Lock()

    @property
    def records(self) -> int:
        return self._records

    def add(self, record: Record) -> None:
        with self._lock:
            self._builder.add(record)
            self._records += 1

    def add_many(self, records) -> None:
        """`add` for each, under one take of the lock."""
        with self._lock:
            add = self._builder.add
            for record in records:
                add(record)
            self._records += len(records)

    def snapshot(self, filters: Filters | None = None, *, log_info: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            columns = self._builder.build()
            records = self._records
        stats = compute_stats(columns, filters)
        stats["log"] = log_section(**({"records": records} | log_info))
        return stats
