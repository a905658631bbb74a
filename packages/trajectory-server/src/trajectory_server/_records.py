"""Frozen, validated records: trajectory payloads, engine output, locations and the ledger.

Every record validates at construction and names the offending field (``InvalidRecord``), so a
bad value fails at the edge and never reaches the store. Token ids, logprobs and per-token
versions are packed arrays (:mod:`trajectory_server._packed`); lists and tuples are accepted and
converted.

The sampling settings (``SamplingParams``) and why a generation stopped (``FinishReason``) are
engine-adapters' records, used as they are: the engine request carries the very object the store
keeps. Sampling settings built from a peer's input go through :func:`sampling_params`, which
reports a bad field as ``InvalidRecord``; a finished trajectory's reason is one of
:data:`FINISH_REASONS`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from engine_adapters import FinishReason, InvalidRequest, SamplingParams
from trajectory_server._packed import FloatArray, IntArray, as_float_array, as_int_array
from trajectory_server.errors import InvalidRecord

MAX_ID_LENGTH = 512
MAX_VERSION = 2**31 - 1
"""Largest model version: per-token versions travel and are stored as int32."""
MAX_GROUP_SIZE = 4096
"""Most members one ``submit_group`` may expand a prompt into (n or n′)."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise InvalidRecord(
            f"{name} must be a non-empty string of at most {MAX_ID_LENGTH} characters, "
            f"got {value!r:.80}",
            field=name,
            value=value,
        )


def _check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> None:
    if not is_int(value):
        raise InvalidRecord(f"{name} must be an int, got {value!r:.80}", field=name, value=value)
    if minimum is not None and value < minimum:  # type: ignore[operator]
        raise InvalidRecord(f"{name} must be >= {minimum}, got {value!r}", field=name, value=value)
    if maximum is not None and value > maximum:  # type: ignore[operator]
        raise InvalidRecord(
            f"{name} must be <= {maximum}, got {value!r:.80}", field=name, value=value
        )


def id_tuple(trajectory_ids: Iterable[str]) -> tuple[str, ...]:
    """The ids as a tuple; one string is refused (not split into one-character ids, which could
    name other trajectories)."""
    if isinstance(trajectory_ids, str):
        raise InvalidRecord(
            "trajectory_ids must be a sequence of ids, not one string", field="trajectory_ids"
        )
    return tuple(trajectory_ids)


def check_version(name: str, value: object) -> None:
    """A model version: an int in [0, MAX_VERSION] (per-token versions are int32)."""
    if not is_int(value) or not 0 <= value <= MAX_VERSION:  # type: ignore[operator]
        raise InvalidRecord(
            f"{name} must be an int in [0, {MAX_VERSION}] (versions are stored as int32), "
            f"got {value!r:.80}",
            field=name,
            value=value,
        )


def _check_optional_int(name: str, value: object, *, minimum: int) -> None:
    if value is not None:
        _check_int(name, value, minimum=minimum)


def json_value(value: Any, path: str = "metadata") -> Any:
    """A deep copy of ``value`` as plain JSON types, or ``InvalidRecord`` naming the path."""
    if value is None or isinstance(value, bool | str):
        return value
    if is_int(value):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRecord(f"{path} must be a finite number, got {value!r}", field=path)
        return value
    if isinstance(value, list | tuple):
        return [json_value(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidRecord(f"{path} keys must be strings, got {k!r:.40}", field=path)
            out[k] = json_value(v, f"{path}.{k}")
        return out
    raise InvalidRecord(
        f"{path} must hold JSON values (None, bool, int, float, str, list, dict), "
        f"got {type(value).__name__}",
        field=path,
    )


def _metadata(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRecord(
            f"metadata must be a mapping, got {type(value).__name__}", field="metadata"
        )
    return json_value(value)  # type: ignore[no-any-return]


def sampling_params(base: SamplingParams | None = None, **fields: Any) -> SamplingParams:
    """``SamplingParams(**fields)``, or ``base`` with ``fields`` changed: the engine's record,
    which the store keeps as it is. A bad field raises ``InvalidRecord`` naming it, as every
    record of the store does, instead of the engine's ``InvalidRequest``."""
    try:
        return SamplingParams(**fields) if base is None else attrs.evolve(base, **fields)
    except InvalidRequest as exc:
        raise InvalidRecord(str(exc), field=exc.field, value=fields.get(exc.field or "")) from exc


class LocationState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"  # on exactly one named instance
    FINISHED = "finished"
    DROPPED = "dropped"


@attrs.frozen(kw_only=True)
class Location:
    """Where a trajectory is: queued, running on ``instance_id``, finished, or dropped (``reason``)."""

    state: LocationState = attrs.field(converter=LocationState)
    instance_id: str | None = None
    reason: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.state is LocationState.RUNNING) != (self.instance_id is not None):
            raise InvalidRecord(
                f"instance_id is required for state running and forbidden otherwise, got "
                f"state={self.state.value} instance_id={self.instance_id!r}",
                field="instance_id",
            )
        if (self.state is LocationState.DROPPED) != (self.reason is not None):
            raise InvalidRecord(
                f"reason is required for state dropped and forbidden otherwise, got "
                f"state={self.state.value} reason={self.reason!r}",
                field="reason",
            )
        if self.instance_id is not None:
            check_id("instance_id", self.instance_id)
        if self.reason is not None:
            check_id("reason", self.reason)


QUEUED = Location(state=LocationState.QUEUED)
FINISHED = Location(state=LocationState.FINISHED)


@attrs.frozen(kw_only=True)
class Trajectory:
    """One trajectory's payload: the prompt, what has been generated so far, and its bookkeeping.

    ``v_traj`` is None until the first route binds it; every generated token carries the version
    that produced it (each >= ``v_traj``). ``target_length`` is an opaque hint for the sim
    engine (the response length it would reach if never stopped); real engines ignore it.
    """

    trajectory_id: str
    group_id: str
    prompt_token_ids: IntArray = attrs.field(converter=as_int_array)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    metadata: dict[str, Any] = attrs.field(factory=dict, converter=_metadata)
    v_traj: int | None = None
    generated_token_ids: IntArray = attrs.field(factory=IntArray, converter=as_int_array)
    generated_logprobs: FloatArray = attrs.field(factory=FloatArray, converter=as_float_array)
    generated_versions: IntArray = attrs.field(factory=IntArray, converter=as_int_array)
    interruptions: int = 0
    target_length: int | None = None

    def __attrs_post_init__(self) -> None:
        check_id("trajectory_id", self.trajectory_id)
        check_id("group_id", self.group_id)
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRecord(
                "sampling must be an engine_adapters.SamplingParams, got "
                f"{type(self.sampling).__name__}",
                field="sampling",
            )
        if not len(self.prompt_token_ids):
            raise InvalidRecord(
                f"prompt_token_ids of {self.trajectory_id!r} is empty; a prompt needs >= 1 token",
                field="prompt_token_ids",
                trajectory_id=self.trajectory_id,
            )
        n = len(self.generated_token_ids)
        if len(self.generated_logprobs) != n or len(self.generated_versions) != n:
            raise InvalidRecord(
                "generated_token_ids, generated_logprobs and generated_versions must have equal "
                f"lengths, got {n}, {len(self.generated_logprobs)}, {len(self.generated_versions)}",
                field="generated_logprobs",
                trajectory_id=self.trajectory_id,
            )
        if n > self.sampling.max_new_tokens:
            raise InvalidRecord(
                f"{self.trajectory_id!r} has {n} generated tokens > max_new_tokens="
                f"{self.sampling.max_new_tokens}",
                field="generated_token_ids",
                trajectory_id=self.trajectory_id,
            )
        if self.v_traj is not None:
            check_version("v_traj", self.v_traj)
        _check_int("interruptions", self.interruptions, minimum=0)
        _check_optional_int("target_length", self.target_length, minimum=0)
        if self.v_traj is None:
            if n or self.interruptions:
                raise InvalidRecord(
                    f"{self.trajectory_id!r} has generated tokens or interruptions but no v_traj",
                    field="v_traj",
                    trajectory_id=self.trajectory_id,
                )
        elif n and self.generated_versions.min() < self.v_traj:  # type: ignore[operator]
            raise InvalidRecord(
                f"{self.trajectory_id!r}: a generated token has version "
                f"{self.generated_versions.min()} < v_traj={self.v_traj}",
                field="generated_versions",
                trajectory_id=self.trajectory_id,
            )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def generated_len(self) -> int:
        return len(self.generated_token_ids)


#: Why a trajectory finished. One that was interrupted (``FinishReason.INTERRUPTED``) is never
#: finished: its output comes back as a partial (``return_partial``) and it runs again.
FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH)
#: The values of :data:`FINISH_REASONS`, as error messages name them
FINISH_REASONS_TEXT = " or ".join(repr(r.value) for r in FINISH_REASONS)


def finish_reason(value: object) -> FinishReason:
    """``value`` as a :data:`FINISH_REASONS` member, or ``InvalidRecord`` naming
    ``finish_reason`` and the values it allows."""
    for reason in FINISH_REASONS:
        if value == reason:
            return reason
    raise InvalidRecord(
        f"finish_reason must be {FINISH_REASONS_TEXT} (an interrupted trajectory is returned "
        f"as a partial, never finished), got {value!r:.40}",
        field="finish_reason",
        value=value,
    )


@attrs.frozen(kw_only=True)
class Segment:
    """Output an instance produced for one trajectory: tokens ``[start, start + len)`` of its
    response. ``start`` may be below what the store holds (an engine that returns the whole
    response so far passes 0); the overlap must then match exactly."""

    trajectory_id: str
    start: int
    token_ids: IntArray = attrs.field(converter=as_int_array)
    logprobs: FloatArray = attrs.field(converter=as_float_array)
    versions: IntArray = attrs.field(converter=as_int_array)

    def __attrs_post_init__(self) -> None:
        check_id("trajectory_id", self.trajectory_id)
        _check_int("start", self.start, minimum=0)
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise InvalidRecord(
                "token_ids, logprobs and versions must have equal lengths, got "
                f"{n}, {len(self.logprobs)}, {len(self.versions)}",
                field="logprobs",
                trajectory_id=self.trajectory_id,
            )

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@attrs.frozen(kw_only=True)
class Completion(Segment):
    """The last segment of a trajectory, with why it stopped."""

    finish_reason: FinishReason = attrs.field(converter=finish_reason)


@attrs.frozen(kw_only=True)
class FinishedTrajectory:
    """A finished trajectory: the full payload, why it stopped, and the instance that did it."""

    trajectory: Trajectory
    finish_reason: FinishReason = attrs.field(converter=finish_reason)
    instance_id: str


@attrs.frozen(kw_only=True)
class QueueEntry:
    """A light view of one queued trajectory, in priority order (what the router reads)."""

    trajectory_id: str
    group_id: str
    v_traj: int | None
    prompt_len: int
    generated_len: int
    interruptions: int


class EventKind(enum.StrEnum):
    SUBMITTED = "submitted"
    ROUTED = "routed"
    RETURNED = "returned"  # interrupted; partial output taken back
    LOST = "lost"  # its instance was lost; back to the queue with what the store held
    FINISHED = "finished"
    DROPPED = "dropped"
    RELEASED = "released"  # the finished payload was collected and freed


#: A trajectory may be routed only right after one of these: it was in the queue.
ROUTABLE_AFTER = frozenset({EventKind.SUBMITTED, EventKind.RETURNED, EventKind.LOST})


def routes_out_of_queue(histories: Mapping[str, Sequence[Sequence[Any]]]) -> list[str]:
    """The ``routed`` events that did not follow a ``submitted`` / ``returned`` / ``lost``
    one — a trajectory routed twice, or routed while not queued — as ``"<id> routed after
    <kind>: <events>"``. ``histories`` maps a trajectory id to its events in order, each a
    sequence whose first item is the kind (e.g. ``[kind, instance_id, version, seq]``)."""
    bad: list[str] = []
    for tid, events in histories.items():
        prev = None
        for event in events:
            kind = event[0]
            if kind == EventKind.ROUTED and prev not in ROUTABLE_AFTER:
                bad.append(f"{tid} routed after {prev}: {events}")
            prev = kind
    return bad


@attrs.frozen(kw_only=True)
class LedgerEvent:
    """One step in a trajectory's history (``seq`` is global and strictly increasing)."""

    seq: int
    trajectory_id: str
    kind: EventKind = attrs.field(converter=EventKind)
    instance_id: str | None = None
    version: int | None = None
    generated_len: int = 0
    reason: str | None = None


@attrs.frozen(kw_only=True)
class StoreStats:
    """Queue depth per level (``None`` = unversioned new prompts) and counts per state."""

    queued_by_level: dict[int | None, int]
    queued: int
    running: int
    finished: int
    dropped: int
    released: int
    running_by_instance: dict[str, int]
    tokens_held: int  # prompt + generated tokens of every payload the store holds

    @property
    def total(self) -> int:
        return self.queued + self.running + self.finished + self.dropped
