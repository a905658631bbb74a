"""Bad input and misuse: a specific exception naming the field or id; state unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sp_helpers import make

from staleness_protocol import (
    BadInput,
    BelowAbortFloor,
    ConfigError,
    CorruptState,
    DuplicateTrajectory,
    GroupClosed,
    InvalidId,
    InvalidVersion,
    NoFreeSlot,
    NotAdmissible,
    NotReady,
    ProtocolConfig,
    ProtocolError,
    ProtocolMisuse,
    SiblingTooStale,
    StalenessProtocol,
    TrajectoryNotInFlight,
    UnknownGroup,
    UnknownTrajectory,
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
    p.consume()
    p.reserve("g0", "a0", 1)
    p.reserve("g0", "a1", 1)
    p.finish("a0")
    p.finish("a1")
    p.reserve("g1", "b0", 1)
    p.reserve("g1", "b1", 1)
    p.finish("b0")
    p.abort("b1", "engine lost")
    p.take_aborts()
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
        "finish an aborted one",
        lambda p: p.finish("b1"),
        TrajectoryNotInFlight,
        {"trajectory_id": "b1", "state": "aborted"},
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
    ("drop a consumed group", lambda p: p.drop_group("w0", "x"), GroupClosed, {"group_id": "w0"}),
    (
        "reserve below the abort floor",
        lambda p: p.reserve("new", "new", 0) if p.abort_floor >= 0 else None,
        BelowAbortFloor,
        {"version": 0},
    ),
    (
        "version from the future",
        lambda p: p.reserve("new", "new", 2),
        InvalidVersion,
        {"version": 2, "current_version": 1},
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
        "resume version from the future",
        lambda p: p.can_resume("b0", 5),
        InvalidVersion,
        {"version": 5},
    ),
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
    for cls in (NoFreeSlot, SiblingTooStale, BelowAbortFloor):
        assert issubclass(cls, NotAdmissible)
    for cls in (
        UnknownTrajectory,
        UnknownGroup,
        DuplicateTrajectory,
        TrajectoryNotInFlight,
        GroupClosed,
        NotReady,
    ):
        assert issubclass(cls, ProtocolMisuse) and not issubclass(cls, NotAdmissible)
    for cls in (InvalidVersion, InvalidId):
        assert issubclass(cls, BadInput) and not issubclass(cls, ProtocolMisuse)
    assert issubclass(UnknownTrajectory, KeyError)


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
    p2.consume()
    p2.reserve("g", "t0", 1)  # -> 2
    p3 = make(batch_size=1, group_size=2, eta=1)
    p3.reserve("w", "w0", 0)
    p3.reserve("w", "w1", 0)
    p3.finish("w0")
    p3.finish("w1")
    p3.consume()
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
        lambda d: d["trajectories"].append(["q", "missing-group", 0, "in_flight", None, None]),
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
