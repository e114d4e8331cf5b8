"""The durable record of every rollout: records, the append-only log, staleness queries,
Parquet export and the benchmark. See docs/replay.md.

Kept import-light (the `inflight` command imports `replay.cli` just to register commands):
import `replay.records`, `replay.log`, `replay.query` or `replay.export` directly.
"""
