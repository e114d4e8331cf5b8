"""Sidecar summaries of segments: `inflight stats` reads a segment from its sidecar only while
the sidecar matches the segment byte for byte, and gets the same statistics either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.errors import CorruptRecordError
from replay.log import FRAME_HEADER, ReplayLog
from replay.query import SIDECAR_SUFFIX, Filters, fromlog, stats_from_log
from tests.unit.test_replay_log import rollout
from tests.unit.test_replay_query import generate_log

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    generate_log(tmp_path)
    return tmp_path


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """Counts segments summarized by scanning (not read from a sidecar)."""
    calls: list[int] = []
    summarize = fromlog.summarize_segment

    def counting(records):
        calls.append(1)
        return summarize(records)

    monkeypatch.setattr(fromlog, "summarize_segment", counting)  # where stats_from_log finds it
    return calls


def segments(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "replay").glob("*.seg"))


def sidecars(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "replay").glob(f"*{SIDECAR_SUFFIX}"))


def as_json(stats: dict) -> str:
    stats = dict(stats)
    stats.pop("log")
    return json.dumps(stats)  # key order too: what `inflight stats --json` prints


@pytest.mark.parametrize("filters", [None, Filters(step_min=5, step_max=20), Filters(engines=("e1",)),
                                     Filters(statuses=("dropped", "errored"))])
def test_statistics_are_identical_with_and_without_sidecars(run_dir, scans, filters):
    scanned = stats_from_log(run_dir, filters)
    n_segments = len(segments(run_dir))
    assert n_segments > 3 and len(scans) == n_segments
    assert [p.name.split(".")[0] for p in sidecars(run_dir)] == [p.stem for p in segments(run_dir)]

    from_sidecars = stats_from_log(run_dir, filters)
    assert len(scans) == n_segments  # nothing scanned the second time
    assert as_json(from_sidecars) == as_json(scanned)
    assert from_sidecars["log"] == scanned["log"]

    verified = stats_from_log(run_dir, filters, sidecars=False)
    assert len(scans) == 2 * n_segments
    assert as_json(verified) == as_json(scanned)


def test_a_sidecar_is_ignored_after_an_append_on_reopen(run_dir, scans):
    before = stats_from_log(run_dir)
    last = segments(run_dir)[-1]
    with ReplayLog.open(run_dir, segment_bytes=10**9) as log:
        log.append(rollout(123_456))
    assert segments(run_dir)[-1] == last
    after = stats_from_log(run_dir)
    assert len(scans) == len(segments(run_dir)) + 1  # only the changed segment was scanned again
    assert after["rollouts"]["total"] == before["rollouts"]["total"] + 1
    assert after["log"]["records"] == before["log"]["records"] + 1
    assert as_json(after) == as_json(stats_from_log(run_dir, sidecars=False))
    assert len([p for p in sidecars(run_dir) if p.name.startswith(last.name)]) == 1  # stale one gone


def test_a_sidecar_is_ignored_when_its_segment_was_cut(run_dir, scans):
    stats_from_log(run_dir)
    last = segments(run_dir)[-1]
    last.write_bytes(last.read_bytes()[:-5])  # a torn tail
    cut = stats_from_log(run_dir)
    assert cut["log"]["torn_tail_bytes"] > 0
    assert as_json(cut) == as_json(stats_from_log(run_dir, sidecars=False))
    assert not [p for p in sidecars(run_dir) if p.name.startswith(f"{last.name}.{last.stat().st_size}.")]


def test_a_flipped_byte_under_a_sidecar_is_still_reported_at_its_offset(run_dir):
    stats_from_log(run_dir)
    first = segments(run_dir)[0]
    data = bytearray(first.read_bytes())
    offset = 16  # the first frame
    data[offset + FRAME_HEADER.size + 2] ^= 0x01
    first.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError) as raised:
        stats_from_log(run_dir)
    assert (raised.value.segment, raised.value.offset) == (first.name, offset)
    lenient = stats_from_log(run_dir, lenient=True)
    assert lenient["log"]["corrupt_records"] == 1
    assert as_json(lenient) == as_json(stats_from_log(run_dir, lenient=True, sidecars=False))


def test_an_unreadable_sidecar_is_ignored(run_dir, scans):
    expected = stats_from_log(run_dir)
    for path in sidecars(run_dir):
        path.write_bytes(b"not a summary")
    assert as_json(stats_from_log(run_dir)) == as_json(expected)
    assert len(scans) == 2 * len(segments(run_dir))
