"""The protocol as the routing strategies see it during one coordinator cycle, with per-cycle
admission caches (see :mod:`rollout_coordinator._cycle`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_coordinator._records import QueuedTrajectory
from staleness_protocol import Admission, ProtocolError

if TYPE_CHECKING:
    from rollout_coordinator._cycle import Coordinator


class _ProtocolPort:
    """The protocol as the routing strategies see it, with per-cycle admission caches."""

    __slots__ = ("_answers", "_closed", "_coord", "_due", "_proto")

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord
        self._proto = coord.protocol
        self._closed: set[int] = set()  # versions where a fresh group is not admitted
        self._due: dict[str, bool] = {}  # group -> reserved in the next buffer (this cycle)
        # (group, version) -> admissible, until the next admission: the protocol's answer
        # changes only when it reserves (nothing else changes it during a cycle), and the
        # members of one group ask the same question one after another
        self._answers: dict[tuple[str, int], bool] = {}

    def admissible(self, group_id: str, version: int) -> bool:
        key = (group_id, version)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._answers[key] = self._admissible(group_id, version)
        return answer

    def _admissible(self, group_id: str, version: int) -> bool:
        fresh = group_id not in self._coord._known_groups
        if fresh and version in self._closed:
            return False
        try:
            answer = self._proto.can_reserve(group_id, version)
        except ProtocolError:  # e.g. an unpublished version
            return False
        if answer is Admission.ADMIT:
            return True
        if fresh and answer is not Admission.DISCARD:  # WAIT / SYNC hold for every new group
            self._closed.add(version)
        return False

    @property
    def admitted_groups(self) -> set[str]:
        return self._coord._known_groups

    def refuses_fresh(self, version: int) -> bool:
        return version in self._closed

    def admit(self, item: QueuedTrajectory, version: int) -> int | None:
        try:
            buffer = self._proto.reserve(item.group_id, item.trajectory_id, version)
        except ProtocolError:
            return None
        self._answers.clear()
        self._coord._known_groups.add(item.group_id)
        self._coord._admitted_total += 1
        return buffer

    def due(self, item: QueuedTrajectory) -> bool:
        answer = self._due.get(item.group_id)
        if answer is None:
            # None when not reserved: unknown to the protocol, occupied, closed; a FIFO (GcFifo)
            # reserves nothing ahead
            proto = self._proto
            answer = self._due[item.group_id] = (
                proto.reserved_buffer(item.group_id) == proto.next_buffer
            )
        return answer

    def can_resume(self, item: QueuedTrajectory, version: int) -> bool:
        try:
            return self._proto.can_resume(item.trajectory_id, version)
        except ProtocolError:
            return False
