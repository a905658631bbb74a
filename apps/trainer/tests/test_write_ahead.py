"""The coordinator loop's write-ahead journal: exact replay, atomic base, checksummed records."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from staleflow_trainer.actors.write_ahead import (
    JournaledProtocol,
    WriteAheadLog,
    replay_state,
)
from staleflow_trainer.errors import CheckpointError
from staleness_protocol import (
    Admission,
    ProtocolConfig,
    ProtocolError,
    StalenessProtocol,
    TrajectoryState,
)


def _drive(p: JournaledProtocol, rng: random.Random, steps: int, start: int = 0) -> int:
    """Random but valid protocol traffic: reserve, finish, drop, abort, consume."""
    n = p.config.samples_per_group
    g = start
    for _ in range(steps):
        for _ in range(rng.randint(0, 3)):
            gid = f"g{g:05d}"
            v = p.published_version
            if p.can_reserve(gid, v) is not Admission.ADMIT:
                break
            for i in range(n):
                try:
                    p.reserve(gid, f"{gid}/{i}", v)
                except ProtocolError:
                    break
            g += 1
        for t in list(p.in_flight()):
            r = rng.random()
            try:
                if r < 0.5:
                    p.finish(t)
                elif r < 0.53:
                    p.drop_group(t.rsplit("/", 1)[0], "filtered: equal rewards")
                elif r < 0.55:
                    p.abort(t, "test abort")
            except ProtocolError:
                pass
        p.take_notices()
        if p.ready():
            p.publish(p.consume().version + 1)
    return g


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_reproduces_the_protocol_exactly(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    cfg = ProtocolConfig(batch_size=4, group_size=4, eta=2, group_redundancy=1, filtering=True)
    p = JournaledProtocol(StalenessProtocol(cfg))
    wal = WriteAheadLog(tmp_path)
    wal.reset({"protocol": p.to_dict(), "groups": {}, "serial": 0})
    g = 0
    for k in range(40):
        g = _drive(p, rng, 3, g)
        wal.append({"ops": p.take_ops(), "groups": [[f"x{k}", k]], "book": {"serial": k}})
        if k == 20:  # fold the journal into a new base halfway
            base, recs = wal.load()
            q, st = replay_state(base, recs)
            wal.compact({"protocol": q.to_dict(), **st})
    base, recs = WriteAheadLog(tmp_path).load()
    q, st = replay_state(base, recs)
    assert q.to_dict() == p.to_dict()
    st_p = p.stats()  # the traffic did reach consumes, drops and aborts
    assert st_p.consumed_batches >= 2 and st_p.replacements_requested > 0
    assert st["serial"] == 39 and st["groups"] == {f"x{k}": k for k in range(40)}
    assert not q.dirty  # replay is not re-recorded
    assert isinstance(q.inner, StalenessProtocol)


def test_failed_calls_are_not_recorded() -> None:
    p = JournaledProtocol(StalenessProtocol(ProtocolConfig(batch_size=1, group_size=2, eta=0)))
    p.reserve("g", "g/0", 0)
    with pytest.raises(ProtocolError):
        p.reserve("g", "g/0", 0)  # twice
    with pytest.raises(ProtocolError):
        p.finish("nope")
    assert p.take_ops() == [["reserve", "g", "g/0", 0]]
    assert p.take_ops() == []
    assert p.trajectory("g/0").state is TrajectoryState.IN_FLIGHT


def _wal_with_records(tmp_path: Path, n: int = 3) -> WriteAheadLog:
    wal = WriteAheadLog(tmp_path)
    p = JournaledProtocol(StalenessProtocol(ProtocolConfig(batch_size=1, group_size=1, eta=0)))
    wal.reset({"protocol": p.to_dict(), "groups": {}})
    for k in range(n):
        p.reserve(f"g{k}", f"g{k}/0", 0) if k == 0 else None
        wal.append({"ops": p.take_ops(), "groups": [], "book": {"k": k}})
    return wal


def test_torn_tail_is_dropped_and_appends_continue(tmp_path: Path) -> None:
    wal = _wal_with_records(tmp_path)
    data = wal.journal_path.read_bytes()
    wal.journal_path.write_bytes(data[:-7])  # the process died mid-append of record 3
    w2 = WriteAheadLog(tmp_path)
    _, recs = w2.load()
    assert [r["seq"] for r in recs] == [1, 2]
    w2.append({"ops": [], "groups": [], "book": {"k": 99}})
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


def test_crash_between_compaction_steps_skips_covered_records(tmp_path: Path) -> None:
    """A new base was written but the old journal not yet emptied: its records are skipped."""
    wal = _wal_with_records(tmp_path)
    old = wal.journal_path.read_bytes()
    base, recs = wal.load()
    q, st = replay_state(base, recs)
    wal.compact({"protocol": q.to_dict(), **st})
    wal.journal_path.write_bytes(old)  # as if the crash hit before the empty journal landed
    base2, recs2 = WriteAheadLog(tmp_path).load()
    assert recs2 == [] and json.dumps(base2, sort_keys=True) == json.dumps(
        {"protocol": q.to_dict(), **st}, sort_keys=True
    )


def test_unknown_journal_op_is_refused(tmp_path: Path) -> None:
    wal = _wal_with_records(tmp_path, n=0)
    wal.append({"ops": [["rm_rf"]], "groups": [], "book": {}})
    base, recs = WriteAheadLog(tmp_path).load()
    with pytest.raises(CheckpointError, match="unknown protocol call 'rm_rf'"):
        replay_state(base, recs)
