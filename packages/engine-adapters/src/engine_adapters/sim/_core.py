"""Sans-IO core of the simulated rollout engine: continuous batching in closed form.

Theory of operation
-------------------
Time is data: every public method takes ``now`` (seconds, never decreasing) and the core never
reads a clock. The engine runs *steps*. In a step every *decoding* trajectory produces one token
and at most one trajectory, the *prefill head*, has part of its context computed. A step with
``n`` decoding trajectories and ``kv`` tokens resident for them takes
``τ(n, kv) = k4 + k1·kv + max(k2, b + k3·n)`` (:class:`~engine_adapters.cost_model.CostModel`),
plus the prefill it carries: ``x`` context tokens at positions ``[a, a + x)`` cost
``x·s_tok + s_pos·(x·a + x(x−1)/2)`` (:meth:`SimConfig.prefill_seconds`: linear matmuls plus
causal attention). Every time is divided by ``speed_factor``.

Prefill is chunked under a per-step token budget ``max_num_batched_tokens`` (None: unlimited).
Each decoding trajectory takes one token of it; the rest goes, in admission order, first to the
head and then to waiting trajectories. A trajectory whose whole remaining context fits joins
the decoding batch in that very step (it samples its first token, as a prefill's last chunk
does); the first one that does not fit becomes the head, takes what is left of the budget, and
gets the whole prefill budget of each later step until the step that finishes it. A trajectory
is admitted only while the budget has room, ``running < max_running`` and its whole context
plus one token per decoding trajectory fits in the KV budget (its context is reserved when it is
admitted). Every admission recomputes the whole context, prompt plus any resumed tokens: after
an interrupt, a preemption, a migration or a sync the KV cache is rebuilt from scratch (no
prefix cache).

Between two *boundaries* the batch is constant, so ``kv`` grows by ``n`` per step and the head
takes the same number of tokens per step; the time of ``j`` steps is a quadratic in ``j``,
``S(j) = c0 + c1·j + c2·j(j−1)/2``. The core jumps straight to the next boundary — the earliest
of: a trajectory reaching its stop length, the KV budget running out, the step before the head
would finish its prefill, or a command — and inverts ``S`` in closed form to place a command
that lands mid-stretch. Nothing loops per token.

At a boundary, in this order: (1) trajectories at their stop length finish; (2) a pending
weight load starts (no steps run while loading); (3) while the next step would not fit
(``kv + n > capacity``, ``kv`` counting the head's context and first token) the most recently admitted
trajectory is preempted — the head first, then decoding ones — its KV freed and it goes to the
*front* of the waiting queue; (4) if nothing was preempted, the step's prefill is planned as
above. When a weight load ends, trajectories still held in the engine follow
``kv_after_weight_load``: ``recompute`` returns them to the front of the waiting queue (in
admission order) to re-prefill on the new version, ``keep`` lets them continue on their old
cache; either way their later tokens carry the new version.

A command arriving inside a step takes effect at the end of that step (the step in flight
completes with the old batch); an interrupted trajectory keeps only the tokens of steps
completed by ``now``. A command at exactly a boundary takes effect before the next step starts.

Token ids are synthetic (see :mod:`engine_adapters.sim._tokens`) and produced only when a
result is materialised (:meth:`SimCompletion.to_result`). Generation stops only at the
request's ``stop_token_ids`` or at ``max_new_tokens`` / the model context; ``eos_token_id``
appears at the request's ``target_length`` (its natural end) and stops it only when listed in
``stop_token_ids``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import chain, repeat
from numbers import Real
from operator import add
from typing import Any, NamedTuple

from engine_adapters._contract import EngineSnapshot, FinishReason, GenerateRequest
from engine_adapters._contract import RunningTrajectory as _Running
from engine_adapters.errors import InvalidRequest, UnknownTrajectory
from engine_adapters.sim._completion import SimCompletion
from engine_adapters.sim._config import SimConfig
from engine_adapters.sim._schedule import NO_CARRY, Scheduler, elapsed
from engine_adapters.sim._traj import new_traj


class SnapshotRows(NamedTuple):
    """An :class:`~engine_adapters.EngineSnapshot`'s fields, with the running trajectories as
    columns copied from the engine's own state, in admission order: ``running_ids``,
    ``running_prompts`` and ``running_base`` (a decoding trajectory's generated tokens less
    ``decode_steps``: its count is ``running_base[i] + decode_steps``), then the prefill
    ``head`` (``(trajectory_id, prompt_tokens, generated_tokens)``) if one is being
    prefilled, listed last. A caller can build its own records from the columns, or none
    (:meth:`rows` builds plain tuples)."""

    instance_id: str
    seq: int
    time_s: float
    version: int
    running_ids: tuple[str, ...]
    running_prompts: tuple[int, ...]
    running_base: tuple[int, ...]
    head: tuple[str, int, int] | None
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    throughput_tokens_per_s: float
    decode_steps: int

    def rows(self) -> Iterator[tuple[str, int, int]]:
        """Every running trajectory as ``(trajectory_id, prompt_tokens, generated_tokens)``,
        in order."""
        generated = map(add, self.running_base, repeat(self.decode_steps))
        rows: Iterator[tuple[str, int, int]] = zip(
            self.running_ids, self.running_prompts, generated, strict=True
        )
        return rows if self.head is None else chain(rows, (self.head,))


class SimEngineCore(Scheduler):
    """A simulated rollout instance driven in (virtual) time by its caller.

    Typical driving loop::

        core.add(request, now=t)
        while (t := core.next_event_time()) < math.inf:
            for done in core.advance_to(t):
                ...
    """

    def __init__(
        self, config: SimConfig | None = None, *, instance_id: str = "sim-0", version: int = 0
    ) -> None:
        super().__init__(
            config if config is not None else SimConfig(), instance_id=instance_id, version=version
        )

    # ------------------------------------------------------------------ properties
    @property
    def version(self) -> int:
        """The model version served now (a load in progress does not count until done)."""
        return self._version

    @property
    def now(self) -> float:
        """The latest time the core has been driven to."""
        return self._now

    @property
    def num_running(self) -> int:
        """Admitted trajectories: decoding ones plus the prefill head."""
        return len(self._running) + (self._head is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_ids)

    @property
    def loading(self) -> bool:
        """True while a weight load is pending or in progress."""
        return self._loading is not None or self._pending_load is not None

    @property
    def paused(self) -> bool:
        return self._paused

    def holds(self, trajectory_id: str) -> bool:
        """Whether the trajectory is admitted or waiting inside the engine."""
        return (
            trajectory_id in self._running
            or trajectory_id in self._waiting_ids
            or (self._head is not None and self._head.request.trajectory_id == trajectory_id)
        )

    # ------------------------------------------------------------------ commands
    def add(self, request: GenerateRequest, now: float) -> None:
        """Queue ``request`` at time ``now``; it is admitted at the next step boundary.

        Raises :class:`PromptTooLong` if prompt + resumed tokens leave no room in
        ``max_model_len``, :class:`InvalidRequest` for a duplicate id or token ids outside the
        vocabulary. On error nothing changes. Completions that happened before ``now`` are
        kept and returned by the next :meth:`advance_to`.
        """
        self.add_many([request], now)

    def add_many(self, requests: Sequence[GenerateRequest], now: float) -> None:
        """:meth:`add` for a batch at one time, in order (cheaper: one scheduling pass).

        All are validated first; if any is bad nothing is added.
        """
        self._advance(now)
        ids = [r.trajectory_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("add_many got duplicate trajectory ids", field="trajectory_id")
        for tid in ids:
            if self.holds(tid):
                raise InvalidRequest(
                    f"trajectory {tid!r} is already held by instance {self.instance_id!r}",
                    field="trajectory_id",
                )
        trajs = [new_traj(self.config, r, self.instance_id) for r in requests]
        for traj in trajs:
            self._waiting.append(traj)
            self._waiting_ids[traj.request.trajectory_id] = traj
        if trajs:
            self._touch(now)

    def interrupt(self, trajectory_ids: Sequence[str] | None, now: float) -> list[SimCompletion]:
        """Stop trajectories (``None`` = all held) and return their partials.

        A decoding trajectory keeps the tokens of the steps completed by ``now``. Unknown ids
        raise :class:`UnknownTrajectory` and stop nothing. Results come back in the order
        asked (for ``None``: admitted in admission order, then waiting in queue order).
        """
        self._advance(now)
        head = self._head
        if trajectory_ids is None:
            ids = [*self._running]
            if head is not None:
                ids.append(head.request.trajectory_id)
            ids.extend(t.request.trajectory_id for t in self._waiting)
            ids = [i for i in ids if self.holds(i)]
        else:
            ids = list(dict.fromkeys(trajectory_ids))
            unknown = [i for i in ids if not self.holds(i)]
            if unknown:
                raise UnknownTrajectory(unknown)
        steps_now, on_boundary = self._position(now)
        out: list[SimCompletion] = []
        removed_admitted = False
        for tid in ids:
            traj = self._running.pop(tid, None)
            if traj is not None:
                del self._run_prompt[tid]
                del self._run_base[tid]
                removed_admitted = True
                self._k -= traj.context_at_admit - traj.admit_step
                generated = traj.generated + steps_now - traj.admit_step
            elif head is not None and head.request.trajectory_id == tid:
                removed_admitted = True
                self._head = None
                traj, generated = head, head.generated
            else:
                traj = self._waiting_ids.pop(tid)
                generated = traj.generated
            out.append(self._completion(traj, generated, FinishReason.INTERRUPTED, now))
        if self._waiting_ids and len(self._waiting_ids) != len(self._waiting):
            self._waiting = deque(
                t for t in self._waiting if t.request.trajectory_id in self._waiting_ids
            )
        elif not self._waiting_ids:
            self._waiting.clear()
        if removed_admitted and self._stretch is not None:
            self._cap(steps_now - self._steps + (0 if on_boundary else 1))
            self._advance(now)
        return out

    def load_weights(self, version: int, nbytes: int, now: float) -> float:
        """Load ``version`` (``nbytes`` of weights) in place; returns when it will be served.

        The load starts at the next step boundary (the step in flight finishes on the old
        weights) and takes ``nbytes / bandwidth + constant`` seconds during which no step runs;
        then held trajectories follow ``kv_after_weight_load`` (see the module docstring).
        Raises :class:`InvalidRequest` if a load is already in progress or ``version`` is
        older than the one served; nothing changes then.
        """
        self._advance(now)
        if self.loading:
            raise InvalidRequest(
                f"instance {self.instance_id!r} is already loading weights", field="version"
            )
        if version < self._version:
            raise InvalidRequest(
                f"version {version} is older than the served version {self._version}",
                field="version",
            )
        if nbytes < 0:
            raise InvalidRequest(f"nbytes must be >= 0, got {nbytes}", field="nbytes")
        seconds = self.config.weight_load_seconds(nbytes)
        self._pending_load = (version, seconds)
        self._touch(now)
        if self._loading is not None:
            return self._loading[1]
        return self.next_event_time() + seconds

    def pause(self, now: float) -> None:
        """Stop stepping from the next boundary on; admitted trajectories keep their KV.

        Commands still work while paused (adds queue up, interrupts return partials, a weight
        load runs); nothing is generated until :meth:`resume`.
        """
        self._advance(now)
        if self._paused:
            return
        self._paused = True
        self._touch(now)

    def resume(self, now: float) -> None:
        """Undo :meth:`pause`: stepping restarts at ``now``."""
        self._advance(now)
        if not self._paused:
            return
        self._paused = False
        if self._stretch is None and self._loading is None:
            self._boundary(now, NO_CARRY)

    def set_pace(self, pace: float, now: float) -> None:
        """Run at ``pace`` × the instance's speed from the next step boundary on (0 < pace ≤ 1:
        the share of its compute it gets while something else on a shared host computes; 1
        restores it). The step in progress finishes at the old pace; weight loads keep theirs."""
        if isinstance(pace, bool) or not isinstance(pace, Real) or not 0.0 < pace <= 1.0:
            raise InvalidRequest(f"pace must be in (0, 1], got {pace!r}", field="pace")
        self._advance(now)
        if pace == self.pace:
            return
        old = self.config.speed_factor * self.pace
        self.pace = float(pace)
        self._use_speed(self.config.speed_factor * self.pace)
        st = self._stretch
        if st is not None and st.carry[0]:
            # cut at its step 0, the stretch hands the prefill of the trajectories that joined
            # there to the next one: those seconds were planned at the old pace
            seconds, tokens, joined = st.carry
            st.carry = (seconds * old / (self.config.speed_factor * self.pace), tokens, joined)
        self._touch(now)

    def peek(self, trajectory_id: str, now: float) -> SimCompletion:
        """Progress of a held trajectory at ``now`` without stopping it.

        The returned record's ``finish_reason`` is ``INTERRUPTED`` (it has not finished).
        """
        self._advance(now)
        traj = self._running.get(trajectory_id)
        head = self._head
        if traj is not None:
            steps_now, _ = self._position(now)
            generated = traj.generated + steps_now - traj.admit_step
        elif head is not None and head.request.trajectory_id == trajectory_id:
            traj, generated = head, head.generated
        elif trajectory_id in self._waiting_ids:
            traj = self._waiting_ids[trajectory_id]
            generated = traj.generated
        else:
            raise UnknownTrajectory([trajectory_id])
        return self._completion(traj, generated, FinishReason.INTERRUPTED, now)

    # ------------------------------------------------------------------ time
    def next_event_time(self) -> float:
        """Time of the next boundary (completion, preemption, load end, command); inf if idle."""
        if self._loading is not None:
            return self._loading[1]
        st = self._stretch
        if st is None:
            return math.inf
        return st.t0 + elapsed(st, st.m_end)

    def advance_to(self, t: float) -> list[SimCompletion]:
        """Run the engine up to time ``t``; return what finished (in completion order).

        Also returns completions that happened during earlier commands' catch-up.
        """
        self._advance(t)
        out, self._outbox = self._outbox, []
        return out

    def snapshot(self, now: float) -> EngineSnapshot:
        """The engine's state at ``now`` (advances to ``now`` first).

        ``running`` lists the decoding trajectories and the prefill head; ``kv_used_tokens``
        counts their resident tokens and the head's reservation; ``decode_steps`` is the
        engine's step count (a decoding trajectory's count is that plus a fixed offset).
        """
        rows = self.snapshot_rows(now)
        return EngineSnapshot(
            instance_id=rows.instance_id,
            seq=rows.seq,
            time_s=rows.time_s,
            version=rows.version,
            running=tuple(
                _Running(trajectory_id=tid, prompt_tokens=prompt, generated_tokens=generated)
                for tid, prompt, generated in rows.rows()
            ),
            waiting=rows.waiting,
            kv_used_tokens=rows.kv_used_tokens,
            kv_capacity_tokens=rows.kv_capacity_tokens,
            throughput_tokens_per_s=rows.throughput_tokens_per_s,
            decode_steps=rows.decode_steps,
        )

    def snapshot_rows(self, now: float) -> SnapshotRows:
        """:meth:`snapshot` with the running trajectories as columns (:class:`SnapshotRows`),
        for a caller that builds its own records (it takes a snapshot: the sequence number
        moves on)."""
        self._advance(now)
        steps_now, _ = self._position(now)
        n = len(self._running)
        kv = self._k + n * steps_now if n else 0
        head = self._head
        self._snapshot_seq += 1
        decoding = self._stretch is not None and n > 0
        return SnapshotRows(
            self.instance_id,
            self._snapshot_seq,
            now,
            self._version,
            tuple(self._running),
            tuple(self._run_prompt.values()),
            tuple(self._run_base.values()),
            None if head is None else (head.request.trajectory_id, head.prompt_len, head.generated),
            len(self._waiting_ids),
            kv + (head.context_at_admit if head is not None else 0),
            self._cap_tokens,
            self.cost.throughput(n, kv) if decoding else 0.0,
            steps_now,
        )

    def kv_used_tokens(self, now: float | None = None) -> int:
        """KV tokens resident or reserved at ``now`` (default: the latest driven time)."""
        t = self._now if now is None else now
        steps_now, _ = self._position(t)
        n = len(self._running)
        head = self._head
        return (self._k + n * steps_now if n else 0) + (
            head.context_at_admit if head is not None else 0
        )


def make_core(**kwargs: Any) -> SimEngineCore:
    """Build a core from flat keyword arguments (``SimConfig`` fields + ``instance_id``)."""
    instance_id = kwargs.pop("instance_id", "sim-0")
    version = kwargs.pop("version", 0)
    return SimEngineCore(SimConfig.from_mapping(kwargs), instance_id=instance_id, version=version)
