"""Read checkpoints written by staleness-protocol 0.1 (formats ``…/1``).

A 0.1 state kept every trajectory and group it ever saw, had one version (``current_version``,
which the 0.1 app only checkpointed between training steps, when the weights of that version
existed) and two outboxes. :func:`upgrade` turns it into the current format:

* ``next_buffer = published_version = current_version``;
* live groups and trajectories stay live; consumed trajectories are forgotten (counted);
  aborted and dropped trajectories and every closed group become tombstones stamped with the
  current version, so they are recognised for ``tombstone_versions`` more versions, then
  forgotten like any other;
* queued aborts become ``Abort`` notices, then queued replacement requests
  ``ReplacementRequest`` notices (0.1 kept no order between its two outboxes); an aborted
  trajectory with no queued abort is taken to have been running (a late ``finish`` of it
  answers ALREADY_ENDED rather than raising).

Anything the upgrade cannot read raises CorruptState naming the problem.
"""

from __future__ import annotations

from typing import Any

from .errors import CorruptState

#: 0.1 format name -> current format name
V1_FORMATS = {
    "staleness-protocol/1": "staleness-protocol/2",
    "staleness-protocol-unbounded/1": "staleness-protocol-unbounded/2",
    "staleness-protocol-gcfifo/1": "staleness-protocol-gcfifo/2",
}

_LIVE_GROUP = ("reserved", "occupied")
_LIVE_TRAJ = ("in_flight", "finished", "occupied")
_PLACEMENT_KEYS = ("top", "buffers", "fifo")


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """The current-format equivalent of a 0.1 checkpoint ``data``."""
    fmt = data.get("format")
    if fmt not in V1_FORMATS:
        raise CorruptState(f"format={fmt!r} is not a 0.1 format: allowed {sorted(V1_FORMATS)}")
    try:
        return _upgrade(data, V1_FORMATS[fmt])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptState(
            f"cannot migrate this {fmt} checkpoint: {type(exc).__name__}: {exc}"
        ) from exc


def _upgrade(data: dict[str, Any], new_format: str) -> dict[str, Any]:
    version = int(data["current_version"])
    was_running = {a[0]: bool(a[4]) for a in data["pending_aborts"]}
    groups = []
    tombstones: list[list[Any]] = []
    ended_groups = dict.fromkeys(("consumed", "dropped", "aborted"), 0)
    for gid, state, buffer, members, finished, reason in data["groups"]:
        if state in _LIVE_GROUP:
            groups.append([gid, state, buffer, list(members), list(finished)])
            continue
        ended_groups[state] += 1
        tombstones.append(["group", gid, state, reason, buffer, version])
    trajectories = []
    ended_trajs = dict.fromkeys(("consumed", "dropped", "aborted"), 0)
    for tid, gid, tversion, state, _buffer, reason in data["trajectories"]:
        if state in _LIVE_TRAJ:
            trajectories.append([tid, gid, tversion, state])
            continue
        ended_trajs[state] += 1
        if state != "consumed":
            running = was_running.get(tid, True)
            tombstones.append(
                ["trajectory", tid, gid, tversion, state, reason or state, running, version]
            )
    notices: list[list[Any]] = [["abort", *a] for a in data["pending_aborts"]]
    notices += [["replacement", *r] for r in data["pending_replacements"]]
    out: dict[str, Any] = {
        "format": new_format,
        "config": data["config"],
        "next_buffer": version,
        "published_version": version,
    }
    out.update({k: data[k] for k in _PLACEMENT_KEYS if k in data})
    out.update(
        {
            "groups": groups,
            "trajectories": trajectories,
            "tombstones": tombstones,
            "notices": notices,
            "next_replacement_id": data["next_replacement_id"],
            "replacements_requested": data["replacements_requested"],
            "staleness_histogram": data["staleness_histogram"],
            "group_staleness_histogram": data["group_staleness_histogram"],
            "aborts_by_reason": data["aborts_by_reason"],
            "consumed_batches": data["consumed_batches"],
            "ended": {"trajectories": ended_trajs, "groups": ended_groups},
        }
    )
    return out


def upgraded(data: Any, current: str) -> dict[str, Any]:
    """``data`` in format ``current``: returned as is, or upgraded from its 0.1 format;
    anything else raises CorruptState naming both accepted formats."""
    fmt = data.get("format") if isinstance(data, dict) else type(data).__name__
    if fmt == current:
        return data  # type: ignore[no-any-return]
    if V1_FORMATS.get(fmt) == current:  # type: ignore[arg-type]
        return upgrade(data)
    old = next(k for k, v in V1_FORMATS.items() if v == current)
    raise CorruptState(f"format={fmt!r} is invalid: allowed {current!r} (or {old!r}, migrated)")
