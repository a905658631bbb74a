"""The control shell's write-ahead journal: atomic base, checksummed records, torn tails.

(That replaying the journaled events reproduces the control core exactly is shown by the
control core's state machine test and the control actor's crash tests.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from staleflow_trainer.actors.write_ahead import WriteAheadLog
from staleflow_trainer.errors import CheckpointError


def _wal_with_records(tmp_path: Path, n: int = 3) -> WriteAheadLog:
    wal = WriteAheadLog(tmp_path)
    wal.reset({"steps_done": 0})
    for k in range(n):
        wal.append({"events": [{"kind": "cycle", "at": float(k)}], "book": {"k": k}})
    return wal


def test_records_round_trip_and_compaction_starts_a_new_base(tmp_path: Path) -> None:
    wal = _wal_with_records(tmp_path, n=5)
    base, recs = WriteAheadLog(tmp_path).load()
    assert base == {"steps_done": 0}
    assert [r["seq"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["events"][0]["at"] for r in recs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    wal.compact({"steps_done": 7})
    wal.append({"events": [], "book": {"k": 9}})
    base, recs = WriteAheadLog(tmp_path).load()
    assert base == {"steps_done": 7} and [r["seq"] for r in recs] == [6]


def test_torn_tail_is_dropped_and_appends_continue(tmp_path: Path) -> None:
    wal = _wal_with_records(tmp_path)
    data = wal.journal_path.read_bytes()
    wal.journal_path.write_bytes(data[:-7])  # the process died mid-append of record 3
    w2 = WriteAheadLog(tmp_path)
    _, recs = w2.load()
    assert [r["seq"] for r in recs] == [1, 2]
    w2.append({"events": [], "book": {"k": 99}})
    _, recs = WriteAheadLog(tmp_path).load()
    assert [(r["seq"], r["book"]["k"]) for r in recs] == [(1, 0), (2, 1), (3, 99)]


def test_damaged_record_before_the_tail_is_refused(tmp_path: Path) -> None:
    wal = _wal_with_records(tmp_path)
    lines = wal.journal_path.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b'"k":0', b'"k":7')
    wal.journal_path.write_bytes(b"\n".join(lines))
    with pytest.raises(CheckpointError, match=r"journal\.log: record on line 1 fails"):
        WriteAheadLog(tmp_path).load()


def test_damaged_base_is_refused(tmp_path: Path) -> None:
    wal = _wal_with_records(tmp_path)
    raw = bytearray(wal.base_path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    wal.base_path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"base\.json fails its SHA-256"):
        WriteAheadLog(tmp_path).load()
    wal.base_path.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        WriteAheadLog(tmp_path).load()


def test_sequence_gap_is_refused(tmp_path: Path) -> None:
    wal = _wal_with_records(tmp_path)
    lines = wal.journal_path.read_bytes().split(b"\n")
    del lines[1]  # record 2 vanished, record 3 follows record 1
    wal.journal_path.write_bytes(b"\n".join(lines))
    with pytest.raises(CheckpointError, match="seq 3, expected 2"):
        WriteAheadLog(tmp_path).load()


@pytest.mark.fault
def test_damaged_complete_last_line_is_refused_not_dropped(tmp_path: Path) -> None:
    """Only an unterminated last line can be torn by a crash; a complete last line that fails
    its checksum was acknowledged (its effects may have run): that is corruption."""
    wal = _wal_with_records(tmp_path)
    data = wal.journal_path.read_bytes()
    assert data.endswith(b"\n")
    wal.journal_path.write_bytes(data[:-3] + b"X}\n")
    with pytest.raises(CheckpointError, match=r"journal\.log: record on line 3 fails"):
        WriteAheadLog(tmp_path).load()


def test_crash_between_compaction_steps_skips_covered_records(tmp_path: Path) -> None:
    """A new base was written but the old journal not yet emptied: its records are skipped."""
    wal = _wal_with_records(tmp_path)
    old = wal.journal_path.read_bytes()
    wal.compact({"steps_done": 3})
    wal.journal_path.write_bytes(old)  # as if the crash hit before the empty journal landed
    base2, recs2 = WriteAheadLog(tmp_path).load()
    assert recs2 == [] and json.dumps(base2) == json.dumps({"steps_done": 3})
