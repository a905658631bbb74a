"""UnboundedFifo: no staleness control — the protocol's interface with the bound taken out.

Theory of operation
===================

What it models. Systems that give no per-trajectory staleness guarantee: verl fully-async with
no staleness threshold, AReaL with ``max_staleness`` unset. They keep the rollout busy with a
concurrency cap, put every finished group into one queue, and the trainer takes the first
``B`` groups, whatever version generated them. This class is that, behind the same methods the
coordinator and the app's loop call on :class:`~staleness_protocol.StalenessProtocol`, so a
run switches mode by constructing one or the other.

Admission. A new group is admitted (``can_reserve``/``reserve``) while fewer than
``max_inflight_groups`` groups are in flight (admitted, not yet complete: RESERVED). The
version plays no part beyond being published: any ``0 ≤ v ≤ published_version`` is accepted.
A sibling joins while its group is in flight and has fewer than ``n' = n + group_redundancy``
live members. Refusals: :class:`~staleness_protocol.NoFreeSlot` (the cap is reached: WAIT),
:class:`~staleness_protocol.GroupClosed` / :class:`~staleness_protocol.GroupFull` (DISCARD).

Finish. When ``n`` members of a group have finished, the rest are aborted (``group_surplus``
notices) and the group becomes OCCUPIED at the tail of the FIFO.

Consume. ``ready()`` once the FIFO holds ``B`` groups; ``consume()`` takes the first ``B`` (FIFO,
never reordered by version), trains version ``c = next_buffer`` into ``c + 1``, and returns a
:class:`~staleness_protocol.Batch` whose staleness ``c − V_traj`` is *measured*, never bounded
(histograms in ``stats()``). The FIFO is shown as consecutive virtual buffers ``c, c+1, ...`` of
``B`` groups each (``buffer_fill``, ``stats().buffers``).

What does not exist here. Nothing is ever too stale: ``abort_floor`` is ``-1``, ``must_sync``
is always False, there are no ``stale`` or ``batch_surplus`` aborts, and no stuck buffers
(``resolve_stuck`` reports nothing resolved; ``config.stuck_threshold`` is None). Filtering
(``drop_group``, replacement requests with ``filtering``), caller aborts (``abort``), partial
rollout (``can_resume``: ``V_traj ≤ instance version``), versions and ``publish``, the ledger
queries and its retirement, the notices and checkpoint/restore (``to_dict``/``from_dict``,
format ``staleness-protocol-unbounded/2``) behave as in the bounded protocol. Every error
leaves the state unchanged.

Sans-IO like the rest of the package.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any, Self, TypeVar

import attrs

from ._checks import check_id as _check_id
from ._config import TOMBSTONE_VERSIONS, ConfigDict, _check_filtering, _int_at_least
from ._ledger import Group, Traj
from ._ledger_base import (
    _IN_FLIGHT,
    _OCCUPIED,
    _OCCUPIED_G,
    _RESERVED_G,
    LedgerBase,
)
from ._migrate import upgraded
from ._records import (
    Admission,
    Batch,
    BufferFill,
    GroupState,
    SlotState,
    StuckResolution,
)
from .errors import (
    CorruptState,
    GroupClosed,
    GroupFull,
    InvalidVersion,
    NoFreeSlot,
    NotReady,
)

Id = str | int

UNBOUNDED_FORMAT = "staleness-protocol-unbounded/2"


@attrs.frozen(kw_only=True)
class UnboundedConfig(ConfigDict):
    """What :class:`UnboundedFifo` needs: no ``eta``, a concurrency cap instead.

    Required:
        batch_size: ``B``, groups per training batch (>= 1).
        group_size: ``n``, trajectories per group that are trained on (>= 1).
        max_inflight_groups: how many groups may be admitted and not yet complete at once
            (>= 1): the rollout's concurrency cap. Finished groups waiting in the FIFO do not
            count (their number is not bounded).

    Optional:
        group_redundancy: extra samples per group, ``n' = n + group_redundancy``.
        filtering: when True every ``drop_group`` queues a replacement-prompt request.
        tombstone_versions: see :class:`~staleness_protocol.ProtocolConfig`.

    ``eta`` and ``stuck_threshold`` are None and ``batch_redundancy`` is 0: the mechanisms they
    configure in :class:`~staleness_protocol.ProtocolConfig` do not exist without buffers.
    """

    batch_size: int = attrs.field(validator=_int_at_least(1))
    group_size: int = attrs.field(validator=_int_at_least(1))
    max_inflight_groups: int = attrs.field(validator=_int_at_least(1))
    group_redundancy: int = attrs.field(default=0, validator=_int_at_least(0))
    filtering: bool = attrs.field(default=False, validator=_check_filtering)
    tombstone_versions: int = attrs.field(default=TOMBSTONE_VERSIONS, validator=_int_at_least(1))

    @property
    def eta(self) -> None:
        """No staleness bound."""
        return None

    @property
    def stuck_threshold(self) -> None:
        return None

    @property
    def batch_redundancy(self) -> int:
        return 0

    @property
    def slots_per_buffer(self) -> int:
        return self.batch_size


class UnboundedFifo(LedgerBase):
    """Admission by a concurrency cap, FIFO consumption, staleness measured but not bounded."""

    _FORMAT = UNBOUNDED_FORMAT
    #: The config class this FIFO takes (a subclass may take another).
    _CONFIG: type[ConfigDict] = UnboundedConfig

    __slots__ = ("_fifo", "_inflight")

    def __init__(self, config: UnboundedConfig, *, start_version: int = 0) -> None:
        if not isinstance(config, self._CONFIG):
            raise TypeError(
                f"config must be an {self._CONFIG.__name__}, got {type(config).__name__}"
            )
        self._init_ledger(config, start_version)
        self._config: UnboundedConfig = config
        self._fifo: deque[Id] = deque()  # OCCUPIED groups, in completion order
        self._inflight = 0  # RESERVED groups

    # ------------------------------------------------------------------ properties

    @property
    def config(self) -> UnboundedConfig:
        return self._config

    @property
    def abort_floor(self) -> int:
        """Always -1: no version is ever too stale to place work."""
        return -1

    @property
    def inflight_groups(self) -> int:
        """Groups admitted and not yet complete (what the cap counts)."""
        return self._inflight

    @property
    def queued_groups(self) -> int:
        """Complete groups waiting in the FIFO."""
        return len(self._fifo)

    def must_sync(self, instance_version: int) -> bool:
        """Always False (validates the version): nothing forces a sync without a bound."""
        self._check_version(instance_version, "instance_version")
        return False

    # ------------------------------------------------------------------ admission

    def _join_refusal(self, g: Group) -> GroupClosed | GroupFull | None:
        if g.state is not _RESERVED_G:
            return GroupClosed(
                f"group {g.group_id!r} is {g.state.value}; it takes no new members",
                group_id=g.group_id,
                state=g.state.value,
            )
        if len(g.members) >= self._config.samples_per_group:
            return GroupFull(
                f"group {g.group_id!r} already has {len(g.members)} live members "
                f"(group_size + group_redundancy = {self._config.samples_per_group})",
                group_id=g.group_id,
            )
        return None

    def can_reserve(self, group_id: Id, version: int) -> Admission:
        """What would ``reserve(group_id, <new id>, version)`` do? No side effects.

        ADMIT; WAIT when the in-flight cap is reached; DISCARD for a closed or full group.
        """
        _check_id(group_id, "group_id")
        self._check_version(version)
        g = self._groups.get(group_id)
        if g is None:
            if group_id in self._tombs.groups:
                return Admission.DISCARD
            if self._inflight < self._config.max_inflight_groups:
                return Admission.ADMIT
            return Admission.WAIT
        if g.state is _RESERVED_G and len(g.members) < self._config.samples_per_group:
            return Admission.ADMIT
        return Admission.DISCARD

    def reserve(self, group_id: Id, trajectory_id: Id, version: int) -> int:
        """Admit a trajectory first routed at ``version`` (its V_traj).

        A new group needs the cap to have room (else NoFreeSlot); siblings join an in-flight
        group. Returns the version the group would be trained at if the FIFO were consumed
        with nothing ahead of it (``next_buffer``): there is no reservation to report.
        """
        self._check_new_trajectory(group_id, trajectory_id, version)
        g = self._groups.get(group_id)
        if g is None:
            tomb = self._tombs.groups.get(group_id)
            if tomb is not None:
                raise GroupClosed(
                    f"group {group_id!r} is {tomb.state.value}; it takes no new members",
                    group_id=group_id,
                    state=tomb.state.value,
                )
            cap = self._config.max_inflight_groups
            if self._inflight >= cap:
                raise NoFreeSlot(
                    f"{self._inflight} groups in flight: max_inflight_groups={cap} reached; "
                    f"group {group_id!r} stays queued",
                    version=version,
                    group_id=group_id,
                )
            g = Group(group_id, None)
            self._groups[group_id] = g
            self._gcount[_RESERVED_G] += 1
            self._inflight += 1
        else:
            refusal = self._join_refusal(g)
            if refusal is not None:
                raise refusal
        g.members[trajectory_id] = None
        self._trajs[trajectory_id] = Traj(trajectory_id, group_id, version, _IN_FLIGHT)
        self._tcount[_IN_FLIGHT] += 1
        return self._next

    # ------------------------------------------------------------------ transitions

    def _set_group_state(self, g: Group, state: GroupState) -> None:
        if g.state is _RESERVED_G:
            self._inflight -= 1
        LedgerBase._set_group_state(self, g, state)

    def _release_slot(self, g: Group) -> None:
        if g.state is _OCCUPIED_G:
            self._fifo.remove(g.group_id)

    def _occupy(self, g: Group) -> int:
        """The group is complete: it joins the FIFO. Returns the version it will be trained at
        (``next_buffer`` plus the batches ahead of it)."""
        self._abort_group_surplus(g)
        trajs = self._trajs
        for tid in g.finished:
            self._set_state(trajs[tid], _OCCUPIED)
        self._set_group_state(g, _OCCUPIED_G)
        self._fifo.append(g.group_id)
        return self._next + (len(self._fifo) - 1) // self._config.batch_size

    # ------------------------------------------------------------------ consume

    def ready(self) -> bool:
        """Does the FIFO hold a batch (``B`` complete groups)?"""
        return len(self._fifo) >= self._config.batch_size

    def consume(self) -> Batch:
        """Take the first ``B`` complete groups (FIFO); ``next_buffer`` advances by one."""
        need = self._config.batch_size
        if len(self._fifo) < need:
            raise NotReady(
                f"the FIFO holds {len(self._fifo)} of the {need} complete groups a batch needs",
                buffer=self._next,
            )
        fifo = self._fifo
        return self._take_batch(tuple(fifo.popleft() for _ in range(need)))

    def next_batch_groups(self) -> tuple[Id, ...]:
        """The first ``B`` complete groups of the FIFO (all of them while it holds fewer), in
        order: the next ``consume()`` takes exactly these unless you ``drop_group`` one (only
        ``consume`` removes a complete group; a FIFO that drops what aged out does so right
        after a ``consume``, never between two)."""
        return tuple(islice(self._fifo, self._config.batch_size))

    def resolve_stuck(self) -> StuckResolution:
        """Nothing to resolve: a FIFO batch is any ``B`` complete groups, so none gets stuck."""
        return StuckResolution(resolved=False, buffer=self._next)

    # ------------------------------------------------------------------ queries

    def fifo(self) -> tuple[Id, ...]:
        """Complete groups waiting to be consumed, oldest first."""
        return tuple(self._fifo)

    def buffer_fill(self, version: int) -> BufferFill:
        """The FIFO seen as buffers of ``B`` groups: buffer ``c + i`` holds groups
        ``[i·B, (i+1)·B)`` of the FIFO. Any version ``≥ next_buffer`` exists."""
        c = self._next
        if not isinstance(version, int) or isinstance(version, bool) or version < c:
            raise InvalidVersion(
                f"buffer {version!r} does not exist: allowed an int >= {c}",
                version=version,
                allowed=f"an int >= {c}",
            )
        b = self._config.batch_size
        occ = min(b, max(0, len(self._fifo) - (version - c) * b))
        return BufferFill(version=version, occupied=occ, reserved=0, free=b - occ, ready=occ == b)

    def buffer_slots(self, version: int) -> tuple[SlotState, ...]:
        fill = self.buffer_fill(version)
        return (SlotState.OCCUPIED,) * fill.occupied + (SlotState.EMPTY,) * fill.free

    def _buffer_fills(self) -> tuple[BufferFill, ...]:
        n_buf = -(-len(self._fifo) // self._config.batch_size)
        return tuple(self.buffer_fill(self._next + i) for i in range(n_buf))

    # ------------------------------------------------------------------ checkpoint

    def to_dict(self) -> dict[str, Any]:
        """The state as plain JSON types; exact round trip through ``from_dict``. Its size
        follows the live ledger, not the length of the run."""
        return {
            "format": self._FORMAT,
            "config": self._config.to_dict(),
            **self._versions_to_dict(),
            "fifo": list(self._fifo),
            **self._ledger_to_dict(),
        }

    @classmethod
    def _restore(cls, data: dict[str, Any]) -> Self:
        return _restore(cls, data)


_F = TypeVar("_F", bound=UnboundedFifo)


def _restore(cls: type[_F], data: dict[str, Any]) -> _F:
    data = upgraded(data, cls._FORMAT)
    config: Any = cls._CONFIG.from_dict(dict(data["config"]))
    p = cls(config, start_version=data["next_buffer"])
    p._restore_ledger(data)
    for g in p._groups.values():
        if g.buffer is not None:
            raise CorruptState(f"group {g.group_id!r} has a buffer {g.buffer!r}")
        if g.state is _RESERVED_G:
            p._inflight += 1
        if any(tid not in g.members for tid in g.finished):
            raise CorruptState(
                f"group {g.group_id!r}: a finished member is not a member", group_id=g.group_id
            )
    fifo = list(data["fifo"])
    if len(set(fifo)) != len(fifo) or {
        gid for gid, g in p._groups.items() if g.state is _OCCUPIED_G
    } != set(fifo):
        raise CorruptState("fifo does not list exactly the occupied groups, once each")
    p._fifo.extend(fifo)
    if p._inflight > p._config.max_inflight_groups:
        raise CorruptState(
            f"{p._inflight} groups in flight exceed max_inflight_groups="
            f"{p._config.max_inflight_groups}"
        )
    return p
