"""Bad input and misuse: a specific exception naming the field or id; state unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sp_helpers import make, step

from staleness_protocol import (
    Admission,
    BadInput,
    BelowAbortFloor,
    ConfigError,
    CorruptState,
    DuplicateTrajectory,
    FinishStatus,
    GroupClosed,
    GroupFull,
    GroupNotDroppable,
    InvalidId,
    InvalidVersion,
    NoFreeSlot,
    NotAdmissible,
    NotReady,
    ProtocolConfig,
    ProtocolError,
    ProtocolMisuse,
    PublishOutOfOrder,
    SiblingTooStale,
    StalenessProtocol,
    TrajectoryNotInFlight,
    UnknownGroup,
    UnknownTrajectory,
    VersionNotPublished,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0, "group_size": 1, "eta": 0}, "batch_size"),
        ({"batch_size": -3, "group_size": 1, "eta": 0}, "batch_size"),
        ({"batch_size": 2, "group_size": 0, "eta": 0}, "group_size"),
        ({"batch_size": 2, "group_size": 1, "eta": -1}, "eta"),
        ({"batch_size": 2.0, "group_size": 1, "eta": 0}, "batch_size"),
        ({"batch_size": True, "group_size": 1, "eta": 0}, "batch_size"),
        ({"batch_size": 2, "group_size": 1, "eta": 0, "batch_redundancy": -1}, "batch_redundancy"),
        ({"batch_size": 2, "group_size": 1, "eta": 0, "group_redundancy": -1}, "group_redundancy"),
        ({"batch_size": 2, "group_size": 1, "eta": 0, "filtering": 1}, "filtering"),
        ({"batch_size": 2, "group_size": 1, "eta": 0, "stuck_threshold": 0}, "stuck_threshold"),
        # unworkable: a buffer that lacks every group is empty, not stuck
        ({"batch_size": 4, "group_size": 1, "eta": 0, "stuck_threshold": 4}, "stuck_threshold"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        ProtocolConfig(**kwargs)
    assert e.value.field == field
    assert field in str(e.value) and "allowed" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_config_from_dict_rejects_unknown_field() -> None:
    with pytest.raises(ConfigError) as e:
        ProtocolConfig.from_dict({"batch_size": 1, "group_size": 1, "eta": 0, "etaa": 3})
    assert e.value.field == "etaa"


def _scenario() -> StalenessProtocol:
    """B=2, n=2, η=1, v=1: g0 occupied in 1, g1 reserved in 2 with one finished member."""
    p = make(batch_size=2, group_size=2, eta=1, batch_redundancy=1)
    for g in ("w0", "w1"):
        p.reserve(g, f"{g}a", 0)
        p.reserve(g, f"{g}b", 0)
        p.finish(f"{g}a")
        p.finish(f"{g}b")
    step(p)
    p.reserve("g0", "a0", 1)
    p.reserve("g0", "a1", 1)
    p.finish("a0")
    p.finish("a1")
    p.reserve("g1", "b0", 1)
    p.reserve("g1", "b1", 1)
    p.finish("b0")
    p.abort("b1", "engine lost")
    p.take_notices()
    return p


CASES: list[
    tuple[str, Callable[[StalenessProtocol], object], type[ProtocolError], dict[str, Any]]
] = [
    (
        "unknown trajectory (finish)",
        lambda p: p.finish("nope"),
        UnknownTrajectory,
        {"trajectory_id": "nope"},
    ),
    (
        "unknown trajectory (abort)",
        lambda p: p.abort("nope", "x"),
        UnknownTrajectory,
        {"trajectory_id": "nope"},
    ),
    (
        "unknown trajectory (query)",
        lambda p: p.trajectory(7),
        UnknownTrajectory,
        {"trajectory_id": 7},
    ),
    (
        "unknown trajectory (resume)",
        lambda p: p.can_resume("nope", 1),
        UnknownTrajectory,
        {"trajectory_id": "nope"},
    ),
    (
        "unknown group (drop)",
        lambda p: p.drop_group("nope", "x"),
        UnknownGroup,
        {"group_id": "nope"},
    ),
    (
        "finishing twice",
        lambda p: p.finish("b0"),
        TrajectoryNotInFlight,
        {"trajectory_id": "b0", "state": "finished"},
    ),
    (
        "finish after occupy",
        lambda p: p.finish("a0"),
        TrajectoryNotInFlight,
        {"trajectory_id": "a0", "state": "occupied"},
    ),
    (
        "abort a finished one",
        lambda p: p.abort("b0", "x"),
        TrajectoryNotInFlight,
        {"trajectory_id": "b0"},
    ),
    (
        "duplicate trajectory id",
        lambda p: p.reserve("g1", "b0", 1),
        DuplicateTrajectory,
        {"trajectory_id": "b0"},
    ),
    (
        "reserve into complete group",
        lambda p: p.reserve("g0", "new", 1),
        GroupClosed,
        {"group_id": "g0", "state": "occupied"},
    ),
    (
        "reserve into consumed group",
        lambda p: p.reserve("w0", "new", 1),
        GroupClosed,
        {"group_id": "w0", "state": "consumed"},
    ),
    (
        "drop a consumed group",
        lambda p: p.drop_group("w0", "x"),
        GroupNotDroppable,
        {"group_id": "w0", "state": "consumed"},
    ),
    (
        "publish out of order",
        lambda p: p.publish(3),
        PublishOutOfOrder,
        {"value": 3, "allowed": None},
    ),
    (
        "reserve below the abort floor",
        lambda p: p.reserve("new", "new", 0) if p.abort_floor >= 0 else None,
        BelowAbortFloor,
        {"version": 0},
    ),
    (
        "version not published",
        lambda p: p.reserve("new", "new", 2),
        VersionNotPublished,
        {"version": 2, "published_version": 1},
    ),
    ("negative version", lambda p: p.can_reserve("new", -1), InvalidVersion, {"version": -1}),
    ("version not an int", lambda p: p.reserve("new", "new", "1"), InvalidVersion, {"value": "1"}),
    ("bool version", lambda p: p.can_reserve("new", True), InvalidVersion, {"value": True}),
    ("bad group id type", lambda p: p.reserve(("g",), "new", 1), InvalidId, {"field": "group_id"}),
    (
        "bad trajectory id type",
        lambda p: p.reserve("new", 1.5, 1),
        InvalidId,
        {"field": "trajectory_id"},
    ),
    ("empty abort reason", lambda p: p.abort("b0", ""), InvalidId, {"field": "reason"}),
    ("consume when not ready", lambda p: p.consume(), NotReady, {"version": 1}),
    (
        "resume version not published",
        lambda p: p.can_resume("b0", 5),
        VersionNotPublished,
        {"version": 5},
    ),
    ("sync check of an unpublished version", lambda p: p.must_sync(2), VersionNotPublished, {}),
]


@pytest.mark.parametrize(("name", "call", "exc", "attrs"), CASES, ids=[c[0] for c in CASES])
def test_error_is_specific_and_state_unchanged(
    name: str,
    call: Callable[[StalenessProtocol], object],
    exc: type[ProtocolError],
    attrs: dict[str, Any],
) -> None:
    p = _scenario()
    if exc is BelowAbortFloor:  # make every buffer version 0 can reach READY
        p.reserve("x", "x0", 1)
        p.reserve("x", "x1", 1)
        p.finish("x0")
        p.finish("x1")
        assert p.abort_floor == 0
    before = p.to_dict()
    with pytest.raises(exc) as e:
        call(p)
    for key, value in attrs.items():
        assert getattr(e.value, key) == value, key
    assert p.to_dict() == before


def test_error_tree() -> None:
    assert issubclass(NotAdmissible, ProtocolError)
    admissions = {
        NoFreeSlot: Admission.WAIT,
        SiblingTooStale: Admission.SYNC,
        BelowAbortFloor: Admission.SYNC,
        GroupClosed: Admission.DISCARD,
        GroupFull: Admission.DISCARD,
    }
    for cls, admission in admissions.items():
        assert issubclass(cls, NotAdmissible) and cls.admission is admission
    for cls in (
        UnknownTrajectory,
        UnknownGroup,
        DuplicateTrajectory,
        TrajectoryNotInFlight,
        GroupNotDroppable,
        PublishOutOfOrder,
        NotReady,
    ):
        assert issubclass(cls, ProtocolMisuse) and not issubclass(cls, NotAdmissible)
    for cls in (InvalidVersion, VersionNotPublished, InvalidId):
        assert issubclass(cls, BadInput) and not issubclass(cls, ProtocolMisuse)
    assert issubclass(VersionNotPublished, InvalidVersion)
    assert issubclass(UnknownTrajectory, KeyError)


def test_admission_is_truthy_only_when_admitted() -> None:
    assert [bool(a) for a in Admission] == [True, False, False, False]
    assert Admission.WAIT == "wait"  # a str, as every enum of this package


def test_reserve_refusals_agree_with_can_reserve() -> None:
    """Every NotAdmissible that reserve raises carries the Admission can_reserve answers."""
    p = _scenario()
    p.reserve("x", "x0", 1)
    p.reserve("x", "x1", 1)
    p.finish("x0")
    p.finish("x1")  # buffers 1 and 2 READY: version 0 is below the floor
    cases = [("new", 0), ("g0", 1), ("w0", 1), ("g1", 1)]  # floor, occupied, consumed, ...
    p.reserve("g1", "b2", 1)  # g1 now holds n' = 2 live members: full
    for gid, v in cases:
        answer = p.can_reserve(gid, v)
        with pytest.raises(NotAdmissible) as e:
            p.reserve(gid, f"{gid}-new", v)
        assert e.value.admission is answer, (gid, v)
    assert [p.can_reserve(g, v) for g, v in cases] == [
        Admission.SYNC,
        Admission.DISCARD,
        Admission.DISCARD,
        Admission.DISCARD,
    ]


def test_the_engine_race_is_not_misuse() -> None:
    """finish / abort / drop_group of what the protocol (or the caller) already ended while
    it ran answer typed outcomes; the state does not change."""
    p = _scenario()
    before = p.to_dict()
    out = p.finish("b1")  # the caller aborted b1; its engine finished it anyway
    assert (out.status, out.reason, out.group_id) == (
        FinishStatus.ALREADY_ENDED,
        "engine lost",
        "g1",
    )
    assert p.abort("b1", "again") is False
    assert p.to_dict() == before


def test_publish_one_version_at_a_time_after_its_step_was_consumed() -> None:
    p = make(batch_size=1, group_size=1, eta=1)
    with pytest.raises(PublishOutOfOrder, match="nothing to publish") as e:
        p.publish(1)
    assert e.value.allowed is None
    p.reserve("g", "t", 0)
    p.finish("t")
    p.consume()
    assert (p.next_buffer, p.published_version) == (1, 0)
    with pytest.raises(VersionNotPublished, match="not published yet"):
        p.can_reserve("h", 1)  # the version being trained: its weights do not exist
    for bad in (2, 0, "1", True):
        with pytest.raises(PublishOutOfOrder, match="allowed 1") as e:
            p.publish(bad)  # type: ignore[arg-type]
        assert e.value.allowed == 1
    p.publish(1)
    assert p.published_version == 1 and p.can_reserve("h", 1) is Admission.ADMIT


def test_not_admissible_errors_carry_context_and_leave_state() -> None:
    p = make(batch_size=1, group_size=2, eta=1)
    p.reserve("g", "t0", 0)  # -> 1
    p.reserve("h", "h0", 0)  # -> 0
    before = p.to_dict()
    with pytest.raises(NoFreeSlot) as e:
        p.reserve("k", "k0", 0)
    assert (e.value.group_id, e.value.version) == ("k", 0)
    assert p.to_dict() == before
    # make version 1 exist, then a sibling at 0 cannot join an entry in buffer 2
    p2 = make(batch_size=1, group_size=1, eta=1)
    p2.reserve("w", "w", 0)
    p2.finish("w")
    step(p2)
    p2.reserve("g", "t0", 1)  # -> 2
    p3 = make(batch_size=1, group_size=2, eta=1)
    p3.reserve("w", "w0", 0)
    p3.reserve("w", "w1", 0)
    p3.finish("w0")
    p3.finish("w1")
    step(p3)
    p3.reserve("g", "t0", 1)  # -> 2
    before = p3.to_dict()
    with pytest.raises(SiblingTooStale) as e2:
        p3.reserve("g", "t1", 0)
    assert (e2.value.group_id, e2.value.version, e2.value.buffer) == ("g", 0, 2)
    assert p3.to_dict() == before


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format="other/9"),
        lambda d: d["buffers"][0]["reserved"].extend(["z1", "z2", "z3"]),
        lambda d: d["trajectories"].append(["q", "missing-group", 0, "in_flight"]),
        lambda d: d.update(published_version=d["next_buffer"] + 1),
        lambda d: d["tombstones"].append(["group", "z", "reserved", None, None, 0]),
        lambda d: d["notices"].append(["nonsense"]),
        lambda d: d["groups"].append(d["groups"][0]),
        lambda d: d.pop("top"),
        lambda d: d["config"].update(eta=-1),
    ],
)
def test_from_dict_rejects_corrupt_state(mutate: Callable[[dict[str, Any]], None]) -> None:
    p = _scenario()
    d = p.to_dict()
    mutate(d)
    with pytest.raises((CorruptState, ConfigError)):
        StalenessProtocol.from_dict(d)


def test_start_version_must_be_non_negative() -> None:
    with pytest.raises(InvalidVersion):
        StalenessProtocol(ProtocolConfig(batch_size=1, group_size=1, eta=0), start_version=-1)
