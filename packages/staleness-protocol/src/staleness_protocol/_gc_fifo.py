"""GcFifo: a FIFO that keeps the bound η by throwing away what is too stale.

Theory of operation
===================

What it models. The strict-staleness asynchronous systems that have no per-version buffers:
ROLL Flash (per-prompt start step, samples past the asynchronous ratio garbage-collected),
verl fully-async with a staleness threshold that drops, AReaL when its users drop what exceeds
``max_staleness``. Rollout runs under a coarse in-flight budget, every finished group joins one
queue, the trainer takes the first ``B`` groups in completion order, and anything whose
staleness would exceed η is discarded — that is how they keep the bound without StaleFlow's
reservations. It is the baseline StaleFlow's protocol is meant to beat: the same η, kept by
waste instead of by placement.

Admission. As :class:`~staleness_protocol.UnboundedFifo` (a cap of ``max_inflight_groups``
groups admitted and not complete; the coarse ``(η + v + 1)·B`` budget is the coordinator's
gate on top), plus: nothing is admitted at a version ``≤ abort_floor`` (BelowAbortFloor), and
a sibling whose version would make its group too stale is refused likewise.

The bound. Training version ``c = next_buffer`` may use a group only if
``c − min V_traj ≤ η``. So ``abort_floor = c − η − 1``: work generated at a version ≤ it can
never be trained. Each ``consume`` advances ``c`` and then garbage-collects every group whose
version fell to or below the new floor — in flight (members aborted: the engine's work is
lost) or finished and waiting in the FIFO (its stored results discarded) — closing it ABORTED
with reason ``stale``: one Abort notice per member (``was_running`` tells which), then a
GroupAborted notice. Consequently every group left in the FIFO when ``consume`` runs is
within η; ``consume`` checks it anyway. (A group whose every member the caller aborted has no
version; it keeps its place under the cap until the caller reserves a retry or drops it.)

Everything else (Occupy into the FIFO tail, group redundancy, filtering, caller aborts,
partial rollout, versions and ``publish``, notices, retirement, statistics, checkpoint format
``staleness-protocol-gcfifo/2``) is ``UnboundedFifo``'s.
"""

from __future__ import annotations

import attrs

from ._config import _int_at_least
from ._ledger_base import _OCCUPIED_G, _RESERVED_G, Id
from ._records import AbortReason, Admission, Batch, GroupState, TrajectoryState
from ._unbounded import UnboundedConfig, UnboundedFifo
from .errors import BelowAbortFloor, CorruptState

GC_FIFO_FORMAT = "staleness-protocol-gcfifo/2"


@attrs.frozen(kw_only=True)
class GcFifoConfig(UnboundedConfig):
    """:class:`UnboundedConfig` plus the bound.

    Required:
        batch_size, group_size, max_inflight_groups: as in :class:`UnboundedConfig`.
        eta: the staleness bound (>= 0); groups that would exceed it are discarded.

    Optional: group_redundancy, filtering (as in :class:`UnboundedConfig`).
    """

    eta: int = attrs.field(validator=_int_at_least(0))  # type: ignore[assignment]


class GcFifo(UnboundedFifo):
    """FIFO consumption under a bound η kept by garbage-collecting too-stale groups."""

    _FORMAT = GC_FIFO_FORMAT
    _CONFIG = GcFifoConfig

    __slots__ = ("_eta",)

    def __init__(self, config: GcFifoConfig, *, start_version: int = 0) -> None:
        super().__init__(config, start_version=start_version)
        self._eta = config.eta

    @property
    def config(self) -> GcFifoConfig:
        return self._config  # type: ignore[return-value]

    @property
    def abort_floor(self) -> int:
        """``next_buffer − η − 1``: nothing generated at a version ≤ this can be trained."""
        return self._next - self._eta - 1

    def must_sync(self, instance_version: int) -> bool:
        """True when an instance at this version can produce nothing trainable."""
        self._check_version(instance_version, "instance_version")
        return instance_version <= self.abort_floor

    # ------------------------------------------------------------------ admission

    def can_reserve(self, group_id: Id, version: int) -> Admission:
        """As :meth:`UnboundedFifo.can_reserve`; SYNC at a version ≤ the floor."""
        answer = super().can_reserve(group_id, version)  # validates both arguments
        if answer is Admission.DISCARD or version > self.abort_floor:
            return answer
        return Admission.SYNC

    def reserve(self, group_id: Id, trajectory_id: Id, version: int) -> int:
        """As :meth:`UnboundedFifo.reserve`; BelowAbortFloor at a version ≤ the floor (after
        the DISCARD refusals, so that it agrees with ``can_reserve``)."""
        self._check_new_trajectory(group_id, trajectory_id, version)
        floor = self.abort_floor
        g = self._groups.get(group_id)
        closed = group_id in self._tombs.groups if g is None else self._join_refusal(g) is not None
        if version <= floor and not closed:
            raise BelowAbortFloor(
                f"version {version} <= abort floor {floor} (next_buffer "
                f"{self._next}, eta {self._eta}): nothing it generates can be trained; "
                "the instance must sync",
                version=version,
                abort_floor=floor,
                group_id=group_id,
            )
        return super().reserve(group_id, trajectory_id, version)

    def can_resume(self, trajectory_id: Id, instance_version: int) -> bool:
        """Live, ``V_traj ≤ instance_version``, and the instance is above the floor."""
        ok = super().can_resume(trajectory_id, instance_version)
        return ok and instance_version > self.abort_floor

    # ------------------------------------------------------------------ consume

    def consume(self) -> Batch:
        """Take the first ``B`` complete groups, advance the version, then discard every group
        (in flight or waiting) that can no longer be trained within η."""
        c = self._next
        head = list(self._fifo)[: self._config.batch_size]
        for gid in head:
            v = self._group_version(self._groups[gid])
            if v is not None and c - v > self._eta:
                raise CorruptState(
                    f"group {gid!r} (version {v}) is at the head of the FIFO with staleness "
                    f"{c - v} > eta {self._eta}: it should have been discarded",
                    group_id=gid,
                )
        batch = super().consume()
        self._collect_stale()
        return batch

    def _collect_stale(self) -> None:
        floor = self.abort_floor
        if floor < 0:
            return
        stale = [
            g
            for g in self._groups.values()
            if (g.state is _RESERVED_G or g.state is _OCCUPIED_G)
            and (v := self._group_version(g)) is not None
            and v <= floor
        ]
        for g in stale:
            self._close_group(
                g, GroupState.ABORTED, AbortReason.STALE, TrajectoryState.ABORTED, notify=True
            )
