"""What the control actor answers when asked: the step records, timeline rows and warning
lines the driver drains, the run's summary, and read-only views of the control core, the
trajectory server, the write-ahead journal and the bytes sent (for the driver, the benchmarks
and the tests).

:class:`ControlQueries` is mixed into :class:`~staleflow_trainer.actors.control.ControlActor`,
which owns the state these read; none of them feeds the core an event or carries out an effect.
"""

from __future__ import annotations

from typing import Any

import attrs

from staleflow_trainer.actors import log_relay, reconcile
from staleflow_trainer.actors.shell_io import ShellIO
from staleflow_trainer.actors.write_ahead import WriteAheadLog
from staleflow_trainer.control import ControlCore


class ControlQueries:
    """Mixed into the control actor, which provides ``core``, ``io``, ``_wal``, the records
    not yet drained (``_records``) or not yet confirmed written (``_unconfirmed``), and what a
    resume restored (``_restored``)."""

    core: ControlCore
    io: ShellIO
    _wal: WriteAheadLog
    _records: list[dict[str, Any]]
    _unconfirmed: list[dict[str, Any]]
    _restored: dict[str, Any] | None

    async def drain(self, written_through: int | None = None) -> dict[str, Any]:
        """Step records, timeline rows and warning lines (``log_relay``) produced since the
        last call, and the instances in the run now (for the driver)."""
        # ``written_through``: the last step the driver has written to ``metrics.jsonl``;
        # records after it go into every checkpoint, so a resume can fill the gap a killed
        # driver leaves
        if written_through is not None:
            self._unconfirmed = [r for r in self._unconfirmed
                                 if int(r["step"]) > written_through]  # fmt: skip
        logs = log_relay.take()
        if self.io.fatal is not None and not self._records and not logs:
            raise self.io.fatal  # after the records and lines made before it were handed over
        records, self._records = self._records, []
        return {"records": records, "timeline": self.core.take_timeline(),
                "steps_done": self.core.steps_done, "logs": logs,
                "instances": list(self.io.rollouts)}  # fmt: skip

    def summary_now(self) -> dict[str, Any]:
        st = self.core.protocol.stats()
        return {"steps_done": self.core.steps_done, "version": self.core.published,
                "tokens_total": self.core.report.gen_total, "counters": dict(self.core.counters),
                "staleness_histogram": {str(k): v for k, v in st.staleness_histogram.items()},
                "aborts_by_reason": dict(st.aborts_by_reason),
                "groups_submitted": self.core.feed.serial}  # fmt: skip

    async def summary(self) -> dict[str, Any]:
        return self.summary_now()

    async def ledger(self) -> dict[str, Any]:
        return await reconcile.ledger_report(self.core, self.io)

    async def histories(self) -> dict[str, list[list[Any]]]:
        return await reconcile.histories(self.core, self.io)

    async def protocol_stats(self) -> dict[str, Any]:
        st = self.core.protocol.stats()
        return {"aborts_by_reason": dict(st.aborts_by_reason),
                "replacements_requested": st.replacements_requested,
                "consumed_batches": st.consumed_batches}  # fmt: skip

    async def core_config(self) -> str:
        """The control core's settings, as built from the app config (``repr``)."""
        return repr(self.core.config)

    async def rows(self) -> int:
        return self.io.rows

    async def protocol_state(self) -> dict[str, Any]:
        return dict(self.core.protocol.to_dict())

    async def restored(self) -> dict[str, Any] | None:
        """What a resume restored from the checkpoint, before anything changed it: the
        protocol's state and the groups (id -> dataset row); ``None`` for a fresh run."""
        return self._restored

    async def groups(self) -> dict[str, int]:
        """Group id -> dataset row: the groups the core knows plus those this process
        submitted (settled ones included)."""
        known = {gid: g.row for gid, g in self.core.ledger.groups.items()}
        return {**self.io.submitted, **known}

    async def instances(self) -> list[str]:
        return list(self.io.rollouts)

    async def lost_instances(self) -> list[dict[str, Any]]:
        return list(self.io.lost)

    async def held_by(self, instance_id: str) -> list[str]:
        return list(await self.io.ts.held_by(instance_id))

    async def ts_stats(self) -> dict[str, Any]:
        return attrs.asdict(await self.io.ts.stats())

    async def wal_stats(self) -> dict[str, Any]:
        return {**self._wal.stats, "journal_bytes": self._wal.journal_bytes()}

    async def io_stats(self) -> dict[str, Any]:
        """Bytes sent and received per peer kind, per call, polls by why (``ByteCounts.stats``;
        ``watch`` is a part of ``instances``) — the data-path benchmark reads it."""
        return self.io.byte_stats()
