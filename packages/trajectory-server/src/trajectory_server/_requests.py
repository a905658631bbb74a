"""The request records of the wire protocol (:mod:`trajectory_server._wire` encodes them):
one frozen record per request type, named by its ``TYPE``."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from engine_adapters import SamplingParams
from trajectory_server._groups import GroupByKey
from trajectory_server._packed import IntArray
from trajectory_server._queue import ALL_LEVELS
from trajectory_server._records import Completion, Segment, Trajectory

# -- request records -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Submit:
    TYPE: ClassVar[str] = "submit"
    trajectories: tuple[Trajectory, ...]


@attrs.frozen(kw_only=True)
class SubmitGroup:
    """A group's prompt as its token ids, or as the key it was put under (:class:`PutPrompts`)."""

    TYPE: ClassVar[str] = "submit_group"
    group_id: str
    prompt_token_ids: IntArray | None
    n: int
    sampling: SamplingParams
    metadata: dict[str, Any]
    target_lengths: tuple[int, ...] | None = None
    prompt_key: int | None = None
    echo: bool = True  # False: the answer is the count of members, not their ids


@attrs.frozen(kw_only=True)
class SubmitGroups:
    """Groups by prompt key with one set of sampling parameters (``TrajectoryStore.submit_groups``);
    the answer is how many trajectories were submitted."""

    TYPE: ClassVar[str] = "submit_groups"
    groups: tuple[GroupByKey, ...]
    sampling: SamplingParams
    skip_existing: bool = False


@attrs.frozen(kw_only=True)
class PutPrompts:
    """Prompts put once under integer keys (``TrajectoryStore.prompts``); the answer is how
    many were put."""

    TYPE: ClassVar[str] = "put_prompts"
    keys: tuple[int, ...]
    prompt_token_ids: tuple[IntArray, ...]
    metadata: tuple[dict[str, Any] | None, ...]


@attrs.frozen(kw_only=True)
class Route:
    TYPE: ClassVar[str] = "route"
    instance_id: str
    trajectory_ids: tuple[str, ...]
    version: int


@attrs.frozen(kw_only=True)
class ReturnPartial:
    TYPE: ClassVar[str] = "return_partial"
    instance_id: str
    segments: tuple[Segment, ...]


@attrs.frozen(kw_only=True)
class Finish:
    TYPE: ClassVar[str] = "finish"
    instance_id: str
    completions: tuple[Completion, ...]
    echo: bool = True  # False: the answer is the count finished, not the records


@attrs.frozen(kw_only=True)
class Drop:
    TYPE: ClassVar[str] = "drop"
    trajectory_ids: tuple[str, ...]
    reason: str


@attrs.frozen(kw_only=True)
class DropGroup:
    TYPE: ClassVar[str] = "drop_group"
    group_id: str
    reason: str


@attrs.frozen(kw_only=True)
class InstanceLost:
    TYPE: ClassVar[str] = "instance_lost"
    instance_id: str


@attrs.frozen(kw_only=True)
class Release:
    TYPE: ClassVar[str] = "release"
    trajectory_ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class Free:
    TYPE: ClassVar[str] = "free"
    trajectory_ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class GetFinished:
    TYPE: ClassVar[str] = "finished"
    trajectory_ids: tuple[str, ...] | None = None


@attrs.frozen(kw_only=True)
class QueueView:
    TYPE: ClassVar[str] = "queue_view"
    limit: int | None = None
    level: Any = ALL_LEVELS  # int, None (unversioned) or ALL_LEVELS


@attrs.frozen(kw_only=True)
class FinishedIds:
    TYPE: ClassVar[str] = "finished_ids"


@attrs.frozen(kw_only=True)
class Stats:
    TYPE: ClassVar[str] = "stats"


@attrs.frozen(kw_only=True)
class Locate:
    TYPE: ClassVar[str] = "locate"
    trajectory_ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class Get:
    TYPE: ClassVar[str] = "get"
    trajectory_ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class History:
    TYPE: ClassVar[str] = "history"
    trajectory_id: str


@attrs.frozen(kw_only=True)
class HeldBy:
    TYPE: ClassVar[str] = "held_by"
    instance_id: str


@attrs.frozen(kw_only=True)
class Group:
    TYPE: ClassVar[str] = "group"
    group_id: str


@attrs.frozen(kw_only=True)
class SaveCheckpoint:
    """Write a checkpoint to the path the *server* was configured with (peers name no paths)."""

    TYPE: ClassVar[str] = "save_checkpoint"


@attrs.frozen(kw_only=True)
class Ping:
    TYPE: ClassVar[str] = "ping"


Request = (
    Submit
    | SubmitGroup
    | SubmitGroups
    | Route
    | ReturnPartial
    | Finish
    | Drop
    | DropGroup
    | InstanceLost
    | Release
    | Free
    | GetFinished
    | FinishedIds
    | QueueView
    | Stats
    | Locate
    | Get
    | History
    | HeldBy
    | Group
    | SaveCheckpoint
    | Ping
    | PutPrompts
)


REQUEST_TYPES: dict[str, type] = {
    c.TYPE: c
    for c in (
        Submit,
        SubmitGroup,
        SubmitGroups,
        Route,
        ReturnPartial,
        Finish,
        Drop,
        DropGroup,
        InstanceLost,
        Release,
        Free,
        GetFinished,
        FinishedIds,
        QueueView,
        Stats,
        Locate,
        Get,
        History,
        HeldBy,
        Group,
        SaveCheckpoint,
        Ping,
        PutPrompts,
    )
}
