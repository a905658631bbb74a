"""The trajectory store: payloads, the multi-level queue and ownership (sans-IO).

Theory of operation
-------------------
Every trajectory ever submitted is, at every moment, in exactly one place:

* **queued** — in the multi-level queue, at level ``v_traj`` (``None`` for a prompt that has
  never run). Levels are served oldest version first, unversioned prompts last; within a level
  longer partials come first (they are closest to done and hold the most KV), then FIFO. Among
  the unversioned prompts, a group another member of which has been routed comes before every
  fresh group: the staleness protocol admitted it when that member was routed, so it holds a
  slot in a buffer the trainer will wait for, and a router that stops its scan after a run of
  fresh prompts it cannot place must still reach it.
* **running** on exactly one named instance, which owns it until it returns (``return_partial``,
  the Interrupt path), finishes (``finish``), or is lost (``instance_lost``).
* **finished** — the payload is kept until the caller ``release``s it (after reward), so a
  checkpoint taken in between loses nothing.
* **dropped**, with a reason; the payload is freed.

``route`` binds ``v_traj`` to the instance's version at the first route and never changes it;
a trajectory can only run at a version >= its ``v_traj``. Output comes back as a
:class:`Segment` covering tokens ``[start, end)`` of the response; it must not leave a gap and
any overlap with what the store holds must match exactly, so a duplicated or reordered message
is rejected rather than silently doubling tokens.

Every operation validates all of its inputs before it changes anything: an error leaves the
store exactly as it was. No clocks, I/O, threads or logging here; the service shell adds those.

The parts live beside this module: the multi-level queue in ``_queue``, the segment rules in
``_segments``, the consistency check in ``_invariants``, the checkpoint state in ``_state``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from engine_adapters import SamplingParams
from trajectory_server._groups import (
    GroupByKey,
    check_batch,
    check_group_size,
    expand,
    prompt_of,
)
from trajectory_server._invariants import check_store
from trajectory_server._queue import ALL_LEVELS, queue_entry
from trajectory_server._records import (
    FINISHED,
    QUEUED,
    Completion,
    EventKind,
    FinishedTrajectory,
    LedgerEvent,
    Location,
    LocationState,
    QueueEntry,
    Segment,
    Trajectory,
    check_id,
    check_version,
)
from trajectory_server._segments import extend
from trajectory_server._state import STATE_FORMAT, store_from_dict, store_to_dict
from trajectory_server._views import StoreViews
from trajectory_server.errors import (
    DuplicateTrajectory,
    InvalidRecord,
    NotQueued,
    StaleVersion,
    UnknownGroup,
    WrongOwner,
    WrongState,
)

__all__ = ["ALL_LEVELS", "STATE_FORMAT", "TrajectoryStore"]


class TrajectoryStore(StoreViews):
    """Synchronous store of trajectory payloads; see the module docstring for the rules. Its
    state and read-only queries are :class:`~trajectory_server._views.StoreViews`'."""

    # -- submission ------------------------------------------------------------------------------

    def submit(self, trajectories: Sequence[Trajectory]) -> tuple[str, ...]:
        """Queue new trajectories (never-routed: ``v_traj`` None, nothing generated)."""
        trajectories = list(trajectories)
        seen: set[str] = set()
        for t in trajectories:
            if not isinstance(t, Trajectory):
                raise InvalidRecord(
                    f"submit takes Trajectory records, got {type(t).__name__}", field="trajectories"
                )
            tid = t.trajectory_id
            if tid in self._where or tid in seen:
                raise DuplicateTrajectory(
                    f"trajectory {tid!r} was already submitted", trajectory_id=tid
                )
            if t.v_traj is not None or t.generated_len or t.interruptions:
                raise InvalidRecord(
                    f"submit takes fresh prompts; {tid!r} has v_traj={t.v_traj}, "
                    f"{t.generated_len} generated tokens, {t.interruptions} interruptions",
                    field="v_traj",
                    trajectory_id=tid,
                )
            seen.add(tid)
        for t in trajectories:
            tid = t.trajectory_id
            self._payload[tid] = t
            self._where[tid] = QUEUED
            self._groups.setdefault(t.group_id, []).append(tid)
            self._enqueue(t)
            self._log(tid, EventKind.SUBMITTED)
        return tuple(t.trajectory_id for t in trajectories)

    def submit_group(
        self,
        group_id: str,
        prompt_token_ids: Iterable[int] | None,
        n: int,
        *,
        sampling: SamplingParams | None = None,
        metadata: Mapping[str, Any] | None = None,
        target_lengths: Sequence[int] | None = None,
        prompt_key: int | None = None,
    ) -> tuple[str, ...]:
        """Expand one prompt into ``n`` trajectories ``{group_id}/{i}`` (pass n' for group-level
        redundancy). With a sampling ``seed``, member ``i`` gets ``seed + i`` so members differ.
        The prompt comes as ``prompt_token_ids`` or as ``prompt_key``, a key of :attr:`prompts`
        (its metadata then under ``metadata``'s entries), never both."""
        check_id("group_id", group_id)
        check_group_size(n, target_lengths)
        tokens, metadata = prompt_of(self.prompts, prompt_token_ids, prompt_key, metadata)
        sampling = sampling if sampling is not None else SamplingParams()
        return self.submit(expand(group_id, tokens, n, sampling, metadata, target_lengths))

    def submit_groups(
        self,
        groups: Sequence[GroupByKey],
        *,
        sampling: SamplingParams | None = None,
        skip_existing: bool = False,
    ) -> int:
        """Submit several groups by prompt key (:class:`GroupByKey`), each with ``sampling``
        (its own seed where it has one), all or none; returns how many trajectories were
        submitted. With ``skip_existing``, a group a member of which is already here (it was
        submitted before) is left as it is instead of refused."""
        groups, sampling = check_batch(groups, sampling)
        members: list[Trajectory] = []
        for g in groups:
            if skip_existing and any(f"{g.group_id}/{i}" in self._where for i in range(g.n)):
                continue
            tokens, metadata = self.prompts.get(g.prompt_key)
            members += expand(g.group_id, tokens, g.n, g.sampling(sampling), metadata, None)
        return len(self.submit(members))

    # -- route / interrupt / finish ----------------------------------------------------------------

    def route(
        self, instance_id: str, trajectory_ids: Sequence[str], version: int
    ) -> tuple[Trajectory, ...]:
        """Hand queued trajectories to ``instance_id`` serving ``version``; returns their payloads
        (with ``v_traj`` bound). All or nothing."""
        check_id("instance_id", instance_id)
        check_version("version", version)
        ids = self._unique_ids(trajectory_ids)
        for tid in ids:
            where = self._location(tid)
            if where.state is not LocationState.QUEUED:
                raise NotQueued(
                    f"trajectory {tid!r} is {where.state.value}"
                    + (f" on {where.instance_id!r}" if where.instance_id else "")
                    + ", not queued",
                    trajectory_id=tid,
                    state=where.state.value,
                    owner=where.instance_id,
                )
            v_traj = self._payload[tid].v_traj
            if v_traj is not None and version < v_traj:
                raise StaleVersion(
                    f"trajectory {tid!r} has v_traj={v_traj}; it cannot run at version {version}",
                    trajectory_id=tid,
                    v_traj=v_traj,
                    version=version,
                )
        where = Location(state=LocationState.RUNNING, instance_id=instance_id)
        held = self._running.setdefault(instance_id, {})
        out = []
        for tid in ids:
            t = self._payload[tid]
            self._queue.remove(tid)
            if t.v_traj is None:
                t = attrs.evolve(t, v_traj=version)
                self._payload[tid] = t
                self._group_routed(t.group_id)
            self._where[tid] = where
            held[tid] = None
            self._log(tid, EventKind.ROUTED, instance_id=instance_id, version=version)
            out.append(t)
        return tuple(out)

    def return_partial(
        self, instance_id: str, segments: Sequence[Segment]
    ) -> tuple[QueueEntry, ...]:
        """Interrupt/Return: take back partial output from ``instance_id``; the trajectories go
        back to the queue at their ``v_traj`` level with one more interruption. All or nothing.
        Returns their light queue entries (the payloads stay here; ``get`` reads one)."""
        planned = self._plan_output(instance_id, segments, final=False)
        out = []
        for seg, t in planned:
            t = attrs.evolve(t, interruptions=t.interruptions + 1)
            self._take_from_instance(instance_id, seg.trajectory_id)
            self._payload[seg.trajectory_id] = t
            self._where[seg.trajectory_id] = QUEUED
            self._enqueue(t)
            self._log(
                seg.trajectory_id,
                EventKind.RETURNED,
                instance_id=instance_id,
                generated_len=t.generated_len,
            )
            out.append(queue_entry(t))
        return tuple(out)

    def finish(
        self, instance_id: str, completions: Sequence[Completion]
    ) -> tuple[FinishedTrajectory, ...]:
        """Record finished trajectories from ``instance_id``. All or nothing."""
        planned = self._plan_output(instance_id, completions, final=True)
        out = []
        for seg, t in planned:
            tid = seg.trajectory_id
            assert isinstance(seg, Completion)
            self._take_from_instance(instance_id, tid)
            self._payload[tid] = t
            self._where[tid] = FINISHED
            self._finished[tid] = seg.finish_reason
            self._finished_by[tid] = instance_id
            self._log(
                tid,
                EventKind.FINISHED,
                instance_id=instance_id,
                generated_len=t.generated_len,
                reason=seg.finish_reason.value,
            )
            out.append(
                FinishedTrajectory(
                    trajectory=t, finish_reason=seg.finish_reason, instance_id=instance_id
                )
            )
        return tuple(out)

    def _plan_output(
        self, instance_id: str, segments: Sequence[Segment], *, final: bool
    ) -> list[tuple[Segment, Trajectory]]:
        check_id("instance_id", instance_id)
        segments = list(segments)
        kind = Completion if final else Segment
        seen: set[str] = set()
        planned = []
        for seg in segments:
            if not isinstance(seg, kind) or (not final and isinstance(seg, Completion)):
                raise InvalidRecord(
                    f"expected {kind.__name__} records, got {type(seg).__name__}",
                    field="segments",
                )
            tid = seg.trajectory_id
            if tid in seen:
                raise InvalidRecord(
                    f"trajectory {tid!r} appears twice in one message",
                    field="trajectory_id",
                    trajectory_id=tid,
                )
            seen.add(tid)
            where = self._location(tid)
            if where.state is not LocationState.RUNNING or where.instance_id != instance_id:
                raise WrongOwner(
                    f"instance {instance_id!r} sent output for {tid!r}, which is "
                    f"{where.state.value}"
                    + (f" on {where.instance_id!r}" if where.instance_id else ""),
                    trajectory_id=tid,
                    instance_id=instance_id,
                    owner=where.instance_id,
                    state=where.state.value,
                )
            planned.append((seg, extend(self._payload[tid], seg, final=final)))
        return planned

    # -- drop / lost / release -------------------------------------------------------------------

    def drop(self, trajectory_ids: Sequence[str], reason: str) -> None:
        """Drop trajectories wherever they are (queued, running, finished), recording why."""
        check_id("reason", reason)
        ids = self._unique_ids(trajectory_ids)
        for tid in ids:
            if self._location(tid).state is LocationState.DROPPED:
                raise WrongState(
                    f"trajectory {tid!r} is already dropped ({self._where[tid].reason})",
                    trajectory_id=tid,
                    state="dropped",
                    owner=None,
                )
        where = Location(state=LocationState.DROPPED, reason=reason)
        for tid in ids:
            before = self._where[tid]
            if before.state is LocationState.QUEUED:
                self._queue.remove(tid)
            elif before.state is LocationState.RUNNING:
                assert before.instance_id is not None
                self._take_from_instance(before.instance_id, tid)
            elif tid in self._finished:
                del self._finished[tid]
                del self._finished_by[tid]
            self._released.discard(tid)
            self._payload.pop(tid, None)
            self._where[tid] = where
            self._log(tid, EventKind.DROPPED, instance_id=before.instance_id, reason=reason)

    def drop_group(self, group_id: str, reason: str) -> tuple[str, ...]:
        """Drop every member of ``group_id`` not already dropped; returns their ids."""
        if group_id not in self._groups:
            raise UnknownGroup(f"no group {group_id!r:.80}", group_id=group_id)
        ids = [
            t for t in self._groups[group_id] if self._where[t].state is not LocationState.DROPPED
        ]
        self.drop(ids, reason)
        return tuple(ids)

    def instance_lost(self, instance_id: str) -> tuple[str, ...]:
        """Everything ``instance_id`` held goes back to the queue with the payload the store
        held (output since the last return is gone with the instance). Idempotent."""
        check_id("instance_id", instance_id)
        held = self._running.pop(instance_id, {})
        for tid in held:
            t = self._payload[tid]
            self._where[tid] = QUEUED
            self._enqueue(t)
            self._log(tid, EventKind.LOST, instance_id=instance_id, generated_len=t.generated_len)
        return tuple(held)

    def release(self, trajectory_ids: Sequence[str]) -> tuple[FinishedTrajectory, ...]:
        """Hand out finished payloads and free them (they stay ``finished`` in the ledger)."""
        ids = self._releasable(trajectory_ids)
        out = tuple(self._finished_record(tid) for tid in ids)
        self._free(ids)
        return out

    def free(self, trajectory_ids: Sequence[str]) -> int:
        """Free finished payloads without handing them out (whoever needed them read them with
        :meth:`finished`): what :meth:`release` does, answered with the count alone, so a
        caller that holds ids only never receives the tokens. Returns how many were freed."""
        ids = self._releasable(trajectory_ids)
        self._free(ids)
        return len(ids)

    def _releasable(self, trajectory_ids: Sequence[str]) -> list[str]:
        ids = self._unique_ids(trajectory_ids)
        for tid in ids:
            if tid not in self._finished:
                where = self._location(tid)
                raise WrongState(
                    f"trajectory {tid!r} is {where.state.value}"
                    + (", already released" if tid in self._released else "")
                    + "; only unreleased finished trajectories can be released",
                    trajectory_id=tid,
                    state=where.state.value,
                    owner=where.instance_id,
                )
        return ids

    def _free(self, ids: list[str]) -> None:
        for tid in ids:
            del self._finished[tid]
            del self._finished_by[tid]
            del self._payload[tid]
            self._released.add(tid)
            self._log(tid, EventKind.RELEASED)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every trajectory is in exactly one consistent place."""
        check_store(self)

    # -- checkpoint state ------------------------------------------------------------------------

    def to_dict(self, *, binary: bool = False) -> dict[str, Any]:
        """The whole store as plain data; JSON-able unless ``binary`` (arrays as raw bytes)."""
        return store_to_dict(self, binary=binary)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> TrajectoryStore:
        """Rebuild a store from :meth:`to_dict` output; inconsistent state raises
        :class:`~trajectory_server.errors.CheckpointCorrupt` naming the field."""
        return store_from_dict(cls, state)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write the store atomically with a checksum (see :mod:`trajectory_server.checkpoint`)."""
        from trajectory_server.checkpoint import save_checkpoint

        return save_checkpoint(self, path)

    @classmethod
    def load_checkpoint(cls, path: str | os.PathLike[str]) -> TrajectoryStore:
        """Read and verify a checkpoint; a damaged file raises ``CheckpointCorrupt``."""
        from trajectory_server.checkpoint import load_checkpoint

        return load_checkpoint(path)

    # -- internals -------------------------------------------------------------------------------

    def _enqueue(self, t: Trajectory) -> None:
        self._enqueue_seq += 1
        promoted = t.v_traj is None and t.group_id in self._routed_groups
        self._queue.push(t.trajectory_id, t.v_traj, t.generated_len, self._enqueue_seq, promoted)

    def _group_routed(self, group_id: str) -> None:
        """A member of ``group_id`` was routed for the first time: its never-routed members
        move ahead of the fresh groups (see the module docstring)."""
        if group_id in self._routed_groups:
            return
        self._routed_groups.add(group_id)
        self._queue.promote(self._groups[group_id])

    def _take_from_instance(self, instance_id: str, tid: str) -> None:
        held = self._running[instance_id]
        del held[tid]
        if not held:
            del self._running[instance_id]

    def _log(
        self,
        tid: str,
        kind: EventKind,
        *,
        instance_id: str | None = None,
        version: int | None = None,
        generated_len: int | None = None,
        reason: str | None = None,
    ) -> None:
        self._event_seq += 1
        if generated_len is None:
            t = self._payload.get(tid)
            generated_len = t.generated_len if t is not None else 0
        self._history.setdefault(tid, []).append(
            LedgerEvent(
                seq=self._event_seq,
                trajectory_id=tid,
                kind=kind,
                instance_id=instance_id,
                version=version,
                generated_len=generated_len,
                reason=reason,
            )
        )
