"""What the control core asks its shell to do: typed, frozen effects (see :mod:`.core`).

Effects name trajectories by id; the shell moves the payloads between the trajectory store,
the instances, the reward workers and the trainer. A shell carries out the effects of one
event in the order given before it feeds the next event (commands to different instances are
independent and may run concurrently).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs


def _tuple(items: Iterable[Any]) -> tuple[Any, ...]:
    return items if isinstance(items, tuple) else tuple(items)


@attrs.frozen(kw_only=True, slots=True)
class GroupSpec:
    """A prompt group to create: ``members`` trajectories ``<group_id>/<i>`` of dataset row
    ``row`` (the simulator's rows are positions in its synthetic prompt stream)."""

    group_id: str
    row: int
    members: int


@attrs.frozen(kw_only=True, slots=True)
class SubmitGroups:
    groups: tuple[GroupSpec, ...] = attrs.field(converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class Route:
    """Hand these queued trajectories to ``instance_id``. ``version`` is their V_traj: for a
    new trajectory the version the instance serves it at (reserved through the protocol), for
    a partial its unchanged V_traj (the instance serves that version or a newer one)."""

    instance_id: str
    version: int
    trajectory_ids: tuple[str, ...] = attrs.field(converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class Interrupt:
    """Stop these on ``instance_id``. ``requeue``: they go back to the queue with their
    output (migration, bounce); else the protocol let them go: discard them (``reason``)."""

    instance_id: str
    trajectory_ids: tuple[str, ...] = attrs.field(converter=_tuple)
    reason: str
    requeue: bool


@attrs.frozen(kw_only=True, slots=True)
class Drop:
    """Discard these trajectories in the store (queued or finished; no instance runs them)."""

    trajectory_ids: tuple[str, ...] = attrs.field(converter=_tuple)
    reason: str


@attrs.frozen(kw_only=True, slots=True)
class DropGroup:
    """The group is closed: discard every member still in the store, never-routed ones too."""

    group_id: str
    reason: str


@attrs.frozen(kw_only=True, slots=True)
class Sync:
    """``instance_id`` stops its work (back to the queue) and loads ``version``."""

    instance_id: str
    version: int


@attrs.frozen(kw_only=True, slots=True)
class Score:
    """Compute the rewards of these finished trajectories (answer with ``Rewarded``)."""

    trajectory_ids: tuple[str, ...] = attrs.field(converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class _Groups:
    """Groups of buffer ``version`` for the trainer: ``trajectory_ids[g]`` are the kept members
    of ``group_ids[g]``, ``staleness`` and ``rewards`` per trajectory in the same order;
    ``tokens`` (prompt + response) and ``response_tokens`` their totals (the simulator times
    the trainer's work by them)."""

    version: int
    group_ids: tuple[str, ...] = attrs.field(converter=_tuple)
    trajectory_ids: tuple[tuple[str, ...], ...] = attrs.field(converter=_tuple)
    staleness: tuple[tuple[int, ...], ...] = attrs.field(converter=_tuple)
    rewards: tuple[tuple[float, ...], ...] = attrs.field(converter=_tuple)
    tokens: int = 0
    response_tokens: int = 0

    @property
    def flat_ids(self) -> list[str]:
        return [t for members in self.trajectory_ids for t in members]


@attrs.frozen(kw_only=True, slots=True)
class Train(_Groups):
    """Train buffer ``version`` (producing ``version + 1``); answer with ``Trained``. The
    fields are the whole batch's (:class:`_Groups`), and ``response_lengths`` the members'
    response lengths in the same order (the step record writes them: a group trace the
    simulator can replay).
    """

    response_lengths: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class TrainPart(_Groups):
    """Groups already settled in the batch the trainer takes next (buffer ``version``), sent
    before it is complete (``trainer.stream_batch``): the trainer starts on them and keeps the
    result for that step's :class:`Train`, which still lists the whole batch. No answer; one
    that arrives after its step ended is ignored."""


@attrs.frozen(kw_only=True, slots=True)
class Release:
    """A trained batch: free its payloads in the store."""

    trajectory_ids: tuple[str, ...] = attrs.field(converter=_tuple)


@attrs.frozen(kw_only=True, slots=True)
class Record:
    """One training step's metrics record (the metrics contract, :mod:`.report`)."""

    row: Mapping[str, Any]


@attrs.frozen(kw_only=True, slots=True)
class Checkpoint:
    """A checkpoint is due after ``step`` steps (the core's state is in :meth:`to_dict`)."""

    step: int


@attrs.frozen(kw_only=True, slots=True)
class Done:
    """The run trained all its steps; stop the instances."""

    steps: int


@attrs.frozen(kw_only=True, slots=True)
class Halt:
    """The run cannot go on (``component`` failed for good); the core takes no more events."""

    component: str
    reason: str


Effect = (
    SubmitGroups
    | Route
    | Interrupt
    | Drop
    | DropGroup
    | Sync
    | Score
    | Train
    | TrainPart
    | Release
    | Record
    | Checkpoint
    | Done
    | Halt
)
