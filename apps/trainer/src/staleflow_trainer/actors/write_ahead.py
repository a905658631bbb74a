"""The control shell's write-ahead journal: the control core's state survives a crash.

Theory of operation
-------------------
The control core (:mod:`staleflow_trainer.control`) is deterministic and sans-IO, so its state
is its base state plus the events fed to it since. Rule: **every event is durable before any
effect it causes reaches another process** (the trajectory server, an instance, a reward
worker, the trainer). The Ray control shell appends each batch of events it is about to feed
(one fsync per batch) and only then carries out their effects; a replacement shell loads the
base, replays the events (effects are not carried out again) and reconciles the other
processes forward to the core (see :mod:`.control`).

On disk (``RUN_DIR/coordinator_wal/``)::

    base.json     "<sha256>\\n<json>": the core's state at journal sequence number ``seq``,
                  written to a temp file, fsynced, renamed (never half there)
    journal.log   one line per record: "<sha256> <json record>", appended and fsynced;
                  records carry consecutive ``seq`` numbers after the base's

Only the last line can be torn (the process died mid-append): a final line *without* its
newline was never acknowledged, so none of its effects ran, and it is dropped on load. A bad
checksum on a complete (newline-terminated) line, anywhere, a gap in the sequence or a damaged
base is corruption: :class:`CheckpointError` naming the file and line. Compaction (at every
checkpoint, or when the journal passes ``compact_bytes``) writes a new base and then an empty
journal; records at or below the base's ``seq`` are skipped, so a crash in between is safe.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.atomic_files import replace_atomically, sha256_hex
from staleflow_trainer.errors import CheckpointError

log = structlog.get_logger(__name__)

WAL_DIR = "coordinator_wal"
BASE_FILE = "base.json"
JOURNAL_FILE = "journal.log"
FORMAT = "staleflow-wal/2"
COMPACT_BYTES = 64 << 20


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
        unterminated = bool(lines) and lines[-1] != b""  # the last line lacks its newline
        if not unterminated:
            lines.pop()  # the file ends with a newline (or is empty)
        good_end = 0
        for i, line in enumerate(lines):
            digest, _, payload = line.partition(b" ")
            if not payload or sha256_hex(payload).encode() != digest:
                if unterminated and i == len(lines) - 1:  # torn by a crash mid-append
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
