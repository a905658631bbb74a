"""The coordinator loop's write-ahead journal: its protocol state and bookkeeping survive a crash.

Theory of operation
-------------------
The control loop owns state that lives nowhere else: the staleness protocol (reservations,
buffers, V_traj of every trajectory) and its bookkeeping (data cursor, group serial, reward
scores, the batch being trained). A coordinator process that dies without handing over loses
it, unless it is durable. Rule: **every state change is durable before any effect that depends
on it reaches another process** (the trajectory server, an instance, the trainer). The loop calls
:meth:`WriteAheadLog.commit` right before such effects; a replacement loop loads the committed
state and reconciles the other processes forward to it (see ``coordinator_loop._recover``).

Cheap per change: the protocol's state holds every live trajectory (thousands at B=64, n=16),
so a commit does not rewrite it. Instead
:class:`JournaledProtocol` (a wrapper) records each successful state-changing call (``reserve``,
``finish``, ``abort``, ``drop_group``, ``consume``, ``publish``, ``resolve_stuck``,
``take_notices``); the protocol is deterministic and sans-IO, so replaying those calls on
the last base state reproduces it exactly. The bookkeeping is small except the group index
(every group ever submitted), which is journaled as new entries; the rest is written per key
only when it changed.

On disk (``RUN_DIR/coordinator_wal/``)::

    base.json     "<sha256>\\n<json>": the full state at journal sequence number ``seq``,
                  written to a temp file, fsynced, renamed (never half there)
    journal.log   one line per commit: "<sha256> <json record>", appended and fsynced;
                  records carry consecutive ``seq`` numbers after the base's

A torn last line (the process died mid-append) was never acknowledged, so none of its effects
ran: it is dropped on load. A bad checksum anywhere else, a gap in the sequence or a damaged
base is corruption: :class:`CheckpointError` naming the file (and line). Compaction (at every
checkpoint, or when the journal passes ``compact_bytes``) writes a new base and then an empty
journal; records at or below the base's ``seq`` are skipped, so a crash in between is safe.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.atomic_files import replace_atomically, sha256_hex
from staleflow_trainer.errors import CheckpointError
from staleness_protocol import StalenessProtocol

log = structlog.get_logger(__name__)

WAL_DIR = "coordinator_wal"
BASE_FILE = "base.json"
JOURNAL_FILE = "journal.log"
FORMAT = "staleflow-wal/1"
COMPACT_BYTES = 64 << 20

MUTATORS = (
    "reserve",
    "finish",
    "abort",
    "drop_group",
    "consume",
    "publish",
    "resolve_stuck",
    "take_notices",
)


def _plain(v: Any) -> Any:
    """Ids and reasons as JSON scalars (``AbortReason`` members are ``str`` subclasses)."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return int(v)
    return str(v)


class JournaledProtocol:
    """Wraps the loop's protocol (a ``StalenessProtocol`` or any object with the same
    methods) and records its successful state-changing calls; everything else passes through.

    :meth:`take_ops` hands the calls made since the last take (``[name, *args]``, JSON-plain);
    :meth:`replay` applies such calls without recording them. A call that raises changed
    nothing (the protocol's contract) and is not recorded.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._ops: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take_ops(self) -> list[list[Any]]:
        ops, self._ops = self._ops, []
        return ops

    @property
    def dirty(self) -> bool:
        return bool(self._ops)

    def replay(self, ops: Sequence[Sequence[Any]]) -> None:
        for i, op in enumerate(ops):
            name, *args = op
            if name not in MUTATORS:
                raise CheckpointError(f"journal op {i}: unknown protocol call {name!r}")
            getattr(self.inner, name)(*args)

    def reserve(self, group_id: Any, trajectory_id: Any, version: int) -> Any:
        r = self.inner.reserve(group_id, trajectory_id, version)
        self._ops.append(["reserve", _plain(group_id), _plain(trajectory_id), int(version)])
        return r

    def finish(self, trajectory_id: Any) -> Any:
        r = self.inner.finish(trajectory_id)
        self._ops.append(["finish", _plain(trajectory_id)])
        return r

    def abort(self, trajectory_id: Any, reason: str) -> Any:
        r = self.inner.abort(trajectory_id, reason)
        self._ops.append(["abort", _plain(trajectory_id), str(reason)])
        return r

    def drop_group(self, group_id: Any, reason: str) -> Any:
        r = self.inner.drop_group(group_id, reason)
        self._ops.append(["drop_group", _plain(group_id), str(reason)])
        return r

    def consume(self) -> Any:
        r = self.inner.consume()
        self._ops.append(["consume"])
        return r

    def publish(self, version: int) -> Any:
        r = self.inner.publish(version)
        self._ops.append(["publish", int(version)])
        return r

    def resolve_stuck(self) -> Any:
        r = self.inner.resolve_stuck()
        if r.resolved:  # an unresolved call changes nothing
            self._ops.append(["resolve_stuck"])
        return r

    def take_notices(self) -> Any:
        r = self.inner.take_notices()
        if r:
            self._ops.append(["take_notices"])
        return r


class WriteAheadLog:
    """``root/base.json`` + ``root/journal.log`` (see the module docstring).

    :meth:`reset` starts a journal from a full state; :meth:`append` adds one record;
    :meth:`load` returns the base state and the records after it; :meth:`compact` folds the
    journal into a new base. ``stats`` counts appends, bytes and seconds (fsync included).
    """

    def __init__(self, root: str | Path, *, compact_bytes: int = COMPACT_BYTES) -> None:
        self.root = Path(root)
        self.base_path = self.root / BASE_FILE
        self.journal_path = self.root / JOURNAL_FILE
        self.compact_bytes = int(compact_bytes)
        self.seq = 0
        self._fh: Any = None
        self.stats: dict[str, float] = {
            "appends": 0,
            "bytes": 0,
            "seconds": 0.0,
            "max_seconds": 0.0,
            "compactions": 0,
            "compact_seconds": 0.0,
        }

    # ------------------------------------------------------------------------------ write

    def reset(self, state: Mapping[str, Any]) -> None:
        """A new journal whose base is ``state`` (seq 0)."""
        self.close()
        self.root.mkdir(parents=True, exist_ok=True)
        self.seq = 0
        self._write_base(state)
        replace_atomically(self.journal_path, b"")

    def append(self, record: Mapping[str, Any]) -> int:
        """Append one record durably (write + fsync); returns its ``seq``."""
        t0 = time.perf_counter()
        if self._fh is None:
            self._fh = self.journal_path.open("ab")
        self.seq += 1
        payload = json.dumps({"seq": self.seq, **record}, separators=(",", ":")).encode()
        line = sha256_hex(payload).encode() + b" " + payload + b"\n"
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        dt = time.perf_counter() - t0
        self.stats["appends"] += 1
        self.stats["bytes"] += len(line)
        self.stats["seconds"] += dt
        self.stats["max_seconds"] = max(self.stats["max_seconds"], dt)
        return self.seq

    def journal_bytes(self) -> int:
        return self.journal_path.stat().st_size if self.journal_path.exists() else 0

    def compact(self, state: Mapping[str, Any] | None = None, *, encoded: bytes = b"") -> None:
        """Make ``state`` (which includes every appended record; or ``encoded``, its JSON
        already serialised for a checkpoint) the new base; empty the journal. A crash between
        the two leaves records the base already covers: skipped on load."""
        t0 = time.perf_counter()
        self.close()
        self._write_base(state, encoded=encoded)
        replace_atomically(self.journal_path, b"")
        self.stats["compactions"] += 1
        self.stats["compact_seconds"] += time.perf_counter() - t0

    def _write_base(self, state: Mapping[str, Any] | None, *, encoded: bytes = b"") -> None:
        if not encoded:
            encoded = json.dumps(state, separators=(",", ":")).encode()
        head = json.dumps({"format": FORMAT, "seq": self.seq}, separators=(",", ":")).encode()
        payload = head[:-1] + b',"state":' + encoded + b"}"
        replace_atomically(self.base_path, sha256_hex(payload).encode() + b"\n" + payload)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # ------------------------------------------------------------------------------- read

    def load(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The base state and the records after it, verified. A torn last record is dropped
        (and cut off the file, so later appends follow the last good one); any other damage
        is a :class:`CheckpointError` naming the file."""
        raw = self._read(self.base_path)
        head, sep, payload = raw.partition(b"\n")
        if not sep or sha256_hex(payload).encode() != head.strip():
            raise CheckpointError(
                f"write-ahead base {self.base_path} fails its SHA-256 check",
                path=str(self.base_path),
            )
        base = json.loads(payload)
        if base.get("format") != FORMAT:
            raise CheckpointError(
                f"write-ahead base {self.base_path}: format {base.get('format')!r}, "
                f"expected {FORMAT!r}",
                path=str(self.base_path),
            )
        base_seq = int(base["seq"])
        data = self._read(self.journal_path)
        records: list[dict[str, Any]] = []
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # the file ends with a newline
        good_end = 0
        for i, line in enumerate(lines):
            digest, _, payload = line.partition(b" ")
            if not payload or sha256_hex(payload).encode() != digest:
                if i == len(lines) - 1:  # the last record: torn by a crash mid-append
                    log.warning("wal_torn_tail_dropped", path=str(self.journal_path), line=i + 1)
                    break
                raise CheckpointError(
                    f"write-ahead journal {self.journal_path}: record on line {i + 1} fails its "
                    "SHA-256 check",
                    path=str(self.journal_path),
                )
            rec = json.loads(payload)
            seq = int(rec["seq"])
            good_end += len(line) + 1
            if seq <= base_seq:  # compacted into the base already
                continue
            want = base_seq + len(records) + 1
            if seq != want:
                raise CheckpointError(
                    f"write-ahead journal {self.journal_path}: line {i + 1} has seq {seq}, "
                    f"expected {want}",
                    path=str(self.journal_path),
                )
            records.append(rec)
        if good_end < len(data):
            with self.journal_path.open("r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                os.fsync(fh.fileno())
        self.seq = base_seq + len(records)
        return dict(base["state"]), records

    def _read(self, path: Path) -> bytes:
        if not path.is_file():
            raise CheckpointError(f"write-ahead file {path} is missing", path=str(path))
        return path.read_bytes()


def replay_state(
    base: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    restore: Callable[[dict[str, Any]], Any] = StalenessProtocol.from_dict,
) -> tuple[JournaledProtocol, dict[str, Any]]:
    """The loop state after ``records``: the protocol (``restore(base["protocol"])`` + the
    replayed calls, journaled from here on) and the bookkeeping (base, new groups added,
    changed keys overwritten)."""
    try:
        protocol = JournaledProtocol(restore(dict(base["protocol"])))
    except Exception as e:
        raise CheckpointError(f"write-ahead base: protocol state unreadable: {e}") from e
    state = {k: v for k, v in base.items() if k != "protocol"}
    groups = dict(state.get("groups", {}))
    for rec in records:
        try:
            protocol.replay(rec.get("ops", ()))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"write-ahead journal record {rec.get('seq')}: replay failed: {e!r}"
            ) from e
        for gid, idx in rec.get("groups", ()):
            groups[str(gid)] = int(idx)
        state.update(rec.get("book", {}))
    state["groups"] = groups
    return protocol, state
