"""Staleness buffers: one per version, ``B'`` slots, READY at ``B`` occupied.

Slots are kept as two insertion-ordered dicts of group ids instead of a slot array: occupied
slots are the front ``len(occupied)`` positions in placement order, reserved slots the back
``len(reserved)`` positions. Removing a reservation therefore "compacts" for free (the reserved
block stays contiguous), and every check is O(1).
"""

from __future__ import annotations

from ._records import BufferFill, SlotState

Id = str | int


class Buffer:
    __slots__ = ("need", "occupied", "reserved", "slots", "version")

    def __init__(self, version: int, slots: int, need: int) -> None:
        self.version = version
        self.slots = slots  # B'
        self.need = need  # B
        self.occupied: dict[Id, None] = {}
        self.reserved: dict[Id, None] = {}

    @property
    def ready(self) -> bool:
        return len(self.occupied) >= self.need

    def can_reserve(self) -> bool:
        """Not about to be consumed and has a free slot."""
        occ = len(self.occupied)
        return occ < self.need and occ + len(self.reserved) < self.slots

    # Same condition: a group may occupy only a non-READY buffer with a free slot.
    can_occupy = can_reserve

    @property
    def free(self) -> int:
        return self.slots - len(self.occupied) - len(self.reserved)

    def fill(self) -> BufferFill:
        return BufferFill(
            version=self.version,
            occupied=len(self.occupied),
            reserved=len(self.reserved),
            free=self.free,
            ready=self.ready,
        )

    def slot_states(self) -> tuple[SlotState, ...]:
        """The slot array: OCCUPIED from the front, RESERVED from the back, EMPTY between."""
        return (
            (SlotState.OCCUPIED,) * len(self.occupied)
            + (SlotState.EMPTY,) * self.free
            + (SlotState.RESERVED,) * len(self.reserved)
        )
