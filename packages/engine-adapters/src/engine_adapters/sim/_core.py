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

import heapq
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from engine_adapters._contract import EngineSnapshot, FinishReason, GenerateRequest
from engine_adapters._contract import RunningTrajectory as _Running
from engine_adapters.cost_model import CostModel
from engine_adapters.errors import InvalidRequest, UnknownTrajectory
from engine_adapters.sim._completion import SimCompletion
from engine_adapters.sim._config import SimConfig
from engine_adapters.sim._traj import Traj, mark, new_traj

# Times within this many seconds of a step boundary count as on it, so callers that add up
# step latencies themselves (in another order than the closed form) land where they meant.
_EPS = 1e-9
#: (seconds, tokens, trajectories) of step-1 prefill already planned for trajectories that
#: joined the decoding batch, carried into a re-plan when a command cuts a stretch at step 0.
_Carry = tuple[float, int, int]
_NO_CARRY: _Carry = (0.0, 0, 0)


@attrs.define(slots=True)
class _Stretch:
    t0: float
    n: int  # decoding trajectories
    kv0: int  # their resident tokens at t0
    c0: float  # S(j) = c0 + c1·j + c2·j(j−1)/2 for j >= 1
    c1: float
    c2: float
    m_end: int  # steps until the stretch's boundary
    head: Traj | None = None
    head_first: int = 0  # head prefill tokens in step 1
    head_step: int = 0  # head prefill tokens in each later step
    pf_first: float = 0.0  # prefill seconds of step 1
    pf_a: float = 0.0  # head prefill seconds of step 2; each later step adds pf_d
    pf_d: float = 0.0
    carry: _Carry = _NO_CARRY
    refill: bool = False  # the step-1 budget ran out with trajectories still waiting


class SimEngineCore:
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
        self.config = config if config is not None else SimConfig()
        self.instance_id = instance_id
        self._version = version
        self._now = 0.0
        self._steps = 0  # global steps completed at the start of the current stretch
        self._running: dict[str, Traj] = {}  # decoding; insertion order == admission order
        self._head: Traj | None = None  # admitted after every decoding one, prefill unfinished
        self._waiting: deque[Traj] = deque()
        self._waiting_ids: dict[str, Traj] = {}
        self._heap: list[tuple[int, int, str]] = []  # (finish step, admit seq, id)
        self._k = 0  # Σ (context_at_admit − admit_step) over decoding; kv = _k + n·steps
        self._seq = 0
        self._stretch: _Stretch | None = None
        self._loading: tuple[int, float] | None = None  # (version, done at)
        self._pending_load: tuple[int, float] | None = None  # (version, seconds)
        self._paused = False
        self._outbox: list[SimCompletion] = []
        self._snapshot_seq = 0
        cfg = self.config
        #: The instance's true step-latency model (the config's, at ``speed_factor``).
        self.cost: CostModel = (
            cfg.cost if cfg.speed_factor == 1.0 else cfg.cost.scaled(1.0 / cfg.speed_factor)
        )
        self._cap_tokens = cfg.kv_capacity
        self._budget = cfg.max_num_batched_tokens
        self._pf_lin, self._pf_quad = (c / cfg.speed_factor for c in cfg.prefill)
        cost = self.cost
        self._batch_terms = [cost.batch_term(n) for n in range(min(cfg.max_running, 4096) + 1)]
        self.total_generated_tokens = 0
        self.preemptions = 0
        self.events = 0
        #: Context tokens prefilled (prompts and re-prefills) and the seconds that took.
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0

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
            self._boundary(now, _NO_CARRY)

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
        return st.t0 + _elapsed(st, st.m_end)

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
        counts their resident tokens and the head's reservation.
        """
        self._advance(now)
        steps_now, _ = self._position(now)
        n = len(self._running)
        kv = self._k + n * steps_now if n else 0
        running = [
            _Running(
                trajectory_id=tid,
                prompt_tokens=tr.prompt_len,
                generated_tokens=tr.generated + steps_now - tr.admit_step,
            )
            for tid, tr in self._running.items()
        ]
        head = self._head
        if head is not None:
            running.append(
                _Running(
                    trajectory_id=head.request.trajectory_id,
                    prompt_tokens=head.prompt_len,
                    generated_tokens=head.generated,
                )
            )
        self._snapshot_seq += 1
        decoding = self._stretch is not None and n > 0
        return EngineSnapshot(
            instance_id=self.instance_id,
            seq=self._snapshot_seq,
            time_s=now,
            version=self._version,
            running=tuple(running),
            waiting=len(self._waiting_ids),
            kv_used_tokens=kv + (head.context_at_admit if head is not None else 0),
            kv_capacity_tokens=self._cap_tokens,
            throughput_tokens_per_s=self.cost.throughput(n, kv) if decoding else 0.0,
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

    # ------------------------------------------------------------------ internals
    def _steps_by(self, st: _Stretch, delta: float) -> int:
        """Largest j <= m_end with S(j) <= delta (closed form, then exact fix-up)."""
        delta += _EPS
        if delta < _elapsed(st, 1):
            return 0
        a = st.c2 / 2
        b = st.c1 - a
        c = st.c0 - delta
        if a <= 0:
            j = int((delta - st.c0) / b)
        else:
            j = int((-b + math.sqrt(max(b * b - 4 * a * c, 0.0))) / (2 * a))
        j = min(max(j, 0), st.m_end)
        while j < st.m_end and _elapsed(st, j + 1) <= delta:
            j += 1
        while j > 0 and _elapsed(st, j) > delta:
            j -= 1
        return j

    def _position(self, now: float) -> tuple[int, bool]:
        """(global steps completed by ``now``, whether ``now`` is exactly a step boundary)."""
        st = self._stretch
        if st is None:
            return self._steps, True
        j = self._steps_by(st, now - st.t0)
        return self._steps + j, abs(st.t0 + _elapsed(st, j) - now) <= _EPS

    def _cap(self, m: int) -> None:
        st = self._stretch
        if st is not None and m < st.m_end:
            st.m_end = m

    def _touch(self, now: float) -> None:
        """Make a new command take effect at the next boundary (now if idle)."""
        if self._loading is not None:
            return
        st = self._stretch
        if st is None:
            if not self._paused or self._pending_load is not None:
                self._boundary(now, _NO_CARRY)
            return
        steps_now, on_boundary = self._position(now)
        self._cap(steps_now - self._steps + (0 if on_boundary else 1))
        self._advance(now)

    def _advance(self, t: float) -> None:
        if t < self._now:
            raise InvalidRequest(
                f"time went backwards: {t!r} < {self._now!r} on {self.instance_id!r}", field="now"
            )
        limit = t + _EPS
        while True:
            loading = self._loading
            if loading is not None:
                te = loading[1]
                if te > limit:
                    break
                self.events += 1
                self._finish_load(loading[0])
                self._boundary(te, _NO_CARRY)
                continue
            st = self._stretch
            if st is None:
                break
            j = st.m_end
            # inlined _elapsed(st, j): this loop is the simulator's hot path
            te = st.t0 if j <= 0 else st.t0 + st.c0 + st.c1 * j + st.c2 * j * (j - 1) / 2
            if te > limit:
                break
            self.events += 1
            self._steps += j
            self.total_generated_tokens += st.n * j
            if j == 0:
                self._boundary(te, st.carry)
                continue
            self._commit_prefill(st, j)
            if not self._kv_boundary(st, te):
                self._boundary(te, _NO_CARRY)
        self._now = t

    def _commit_prefill(self, st: _Stretch, j: int) -> None:
        """Account the prefill of ``j >= 1`` executed steps of ``st``; advance its head."""
        seconds = st.pf_first
        tokens = st.carry[1]
        if j > 1:
            seconds += (j - 1) * st.pf_a + st.pf_d * (j - 1) * (j - 2) / 2
        head = st.head
        if head is not None:
            done = st.head_first + (j - 1) * st.head_step
            tokens += done
            if head is self._head:
                head.prefilled += done
        self.prefill_seconds += seconds
        self.prefill_tokens += tokens

    def _finish_load(self, version: int) -> None:
        self._version = version
        self._loading = None
        steps = self._steps
        if self.config.kv_after_weight_load == "keep":
            for tr in self._running.values():
                mark(tr, tr.generated + steps - tr.admit_step, version)
            return
        # recompute: the cache built with the old weights is gone; everything re-prefills
        back = list(self._running.values())
        for tr in back:
            tr.generated += steps - tr.admit_step
        if self._head is not None:
            back.append(self._head)
            self._head = None
        for tr in reversed(back):
            tr.prefilled = 0
            self._waiting.appendleft(tr)
            self._waiting_ids[tr.request.trajectory_id] = tr
        self._running.clear()
        self._heap.clear()
        self._k = 0

    def _kv_boundary(self, st: _Stretch, t: float) -> bool:
        """Fast path of :meth:`_boundary` for a boundary where only preemption happens.

        When the KV budget runs out mid-generation the engine walks through a cascade of such
        boundaries (one preemption each, no completion, no admission); this does exactly what
        :meth:`_boundary` would do there, reusing ``st``. Returns False (changing nothing) when
        the boundary is anything else, for :meth:`_boundary` to handle.
        """
        heap = self._heap
        steps = self._steps
        if (
            (heap and heap[0][0] <= steps)
            or self._pending_load is not None
            or self._paused
            or self._head is not None
        ):
            return False
        cap = self._cap_tokens
        running = self._running
        n = len(running)  # not st.n: an interrupt may have removed some since the stretch began
        k = self._k
        if not n or k + n * steps + n <= cap:
            return False  # no preemption: admission may happen
        waiting = self._waiting
        waiting_ids = self._waiting_ids
        # the same preemption loop as _boundary (its admission is skipped after a preemption)
        while n and k + n * steps + n > cap:
            tid, tr = running.popitem()
            k -= tr.context_at_admit - tr.admit_step
            tr.generated += steps - tr.admit_step
            waiting.appendleft(tr)
            waiting_ids[tid] = tr
            self.preemptions += 1
            n -= 1
        self._k = k
        if not n:
            self._stretch = None
            return True
        while heap[0][2] not in running or running[heap[0][2]].admit_seq != heap[0][1]:
            heapq.heappop(heap)
        kv = k + n * steps
        k1 = self.cost.k1
        st.t0 = t
        st.n = n
        st.kv0 = kv
        st.c0 = 0.0
        st.c1 = self._batch_term(n) + k1 * kv
        st.c2 = k1 * n
        st.m_end = min(heap[0][0] - steps, (cap - kv) // n)
        st.head = None
        st.head_first = st.head_step = 0
        st.pf_first = st.pf_a = st.pf_d = 0.0
        st.carry = _NO_CARRY
        st.refill = False
        return True

    def _batch_term(self, n: int) -> float:
        terms = self._batch_terms
        if n < len(terms):
            return terms[n]
        return self.cost.batch_term(n)

    def _chunk_seconds(self, start: int, count: int) -> float:
        return self._pf_lin * count + self._pf_quad * (count * start + count * (count - 1) / 2)

    def _boundary(self, t: float, carry: _Carry) -> None:
        self._stretch = None
        steps = self._steps
        heap = self._heap
        running = self._running
        while heap and heap[0][0] <= steps:
            _, seq, tid = heapq.heappop(heap)
            tr = running.get(tid)
            if tr is None or tr.admit_seq != seq:
                continue
            del running[tid]
            self._k -= tr.context_at_admit - tr.admit_step
            self._outbox.append(self._completion(tr, tr.stop_len, tr.stop_reason, t))
        if self._pending_load is not None:
            version, seconds = self._pending_load
            self._pending_load = None
            self._loading = (version, t + seconds)
            return
        if self._paused:
            return
        cap = self._cap_tokens
        n = len(running)
        kv = self._k + n * steps  # decoding trajectories' resident tokens
        preempted = False
        while n and kv + self._head_kv() + n > cap:
            preempted = True
            self.preemptions += 1
            head = self._head
            if head is not None:
                self._head = None
                head.prefilled = 0
                self._waiting.appendleft(head)
                self._waiting_ids[head.request.trajectory_id] = head
                continue
            tid, tr = running.popitem()
            self._k -= tr.context_at_admit - tr.admit_step
            tr.generated += steps - tr.admit_step
            self._waiting.appendleft(tr)
            self._waiting_ids[tid] = tr
            n -= 1
            kv = self._k + n * steps
        st = _Stretch(t0=t, n=0, kv0=0, c0=0.0, c1=0.0, c2=0.0, m_end=0, carry=carry)
        if not preempted:
            self._plan(st)
        n = len(running)
        head = self._head
        if not n and head is None:
            return
        kv = self._k + n * steps
        k1 = self.cost.k1
        st.n = n
        st.kv0 = kv
        st.c0 = st.pf_first
        st.c1 = self._batch_term(n) + k1 * kv
        st.c2 = k1 * n
        m_end = math.inf
        if n:
            while heap[0][2] not in running or running[heap[0][2]].admit_seq != heap[0][1]:
                heapq.heappop(heap)
            m_end = min(heap[0][0] - steps, (cap - kv - self._head_kv()) // n)
        if st.refill:
            m_end = 1
        if head is not None:
            assert self._budget is not None  # only a finite budget leaves a head
            per_step = self._budget - n
            left = head.context_at_admit - head.prefilled - st.head_first
            m_end = min(m_end, 1 + (left - 1) // per_step)
            a = self._chunk_seconds(head.prefilled + st.head_first, per_step)
            d = self._pf_quad * per_step * per_step
            st.head = head
            st.head_step = per_step
            st.pf_a, st.pf_d = a, d
            st.c0 += d - a
            st.c1 += a - d
            st.c2 += d
        st.m_end = int(m_end)
        self._stretch = st

    def _head_kv(self) -> int:
        """KV the head holds for scheduling: its context plus the slot of its first token."""
        head = self._head
        return head.context_at_admit + 1 if head is not None else 0

    def _plan(self, st: _Stretch) -> None:
        """Plan step 1's prefill (see the module docstring); admitted ones join at once."""
        carried_s, carried_tokens, carried_n = st.carry
        running = self._running
        n = len(running)
        budget = math.inf if self._budget is None else self._budget
        # decoding trajectories take one token each; those carried in take their chunks
        left = budget - (n - carried_n) - carried_tokens
        seconds = carried_s
        joined_s, joined_tokens, joined_n = carried_s, carried_tokens, carried_n
        head = self._head
        if head is not None:
            rest = head.context_at_admit - head.prefilled
            if rest <= left:
                cost = self._chunk_seconds(head.prefilled, rest)
                seconds += cost
                joined_s, joined_tokens, joined_n = (
                    joined_s + cost,
                    joined_tokens + rest,
                    joined_n + 1,
                )
                left -= rest
                self._head = None
                self._join(head)
            else:
                st.head_first = int(left)
                seconds += self._chunk_seconds(head.prefilled, st.head_first)
                left = 0
        waiting = self._waiting
        if waiting and left > 0 and self._head is None:
            waiting_ids = self._waiting_ids
            max_running = self.config.max_running
            cap = self._cap_tokens
            steps = self._steps
            kv = self._k + len(running) * steps
            while waiting and left > 0 and len(running) < max_running:
                tr = waiting[0]
                context = tr.prompt_len + tr.generated
                if kv + context + len(running) + 1 > cap:
                    break
                waiting.popleft()
                del waiting_ids[tr.request.trajectory_id]
                self._seq += 1
                tr.admit_seq = self._seq
                tr.context_at_admit = context
                tr.prefilled = 0
                kv += context
                if context <= left:
                    cost = self._chunk_seconds(0, context)
                    seconds += cost
                    joined_s += cost
                    joined_tokens += context
                    joined_n += 1
                    left -= context
                    self._join(tr)
                else:
                    self._head = tr
                    st.head_first = int(left)
                    seconds += self._chunk_seconds(0, st.head_first)
                    left = 0
        st.pf_first = seconds
        st.carry = (joined_s, joined_tokens, joined_n)
        # the budget, not KV or max_running, stopped admission: the next step admits more
        st.refill = self._head is None and bool(waiting) and left <= 0

    def _join(self, tr: Traj) -> None:
        """Add an admitted trajectory to the decoding batch: its first token is this step's."""
        steps = self._steps
        tr.admit_step = steps
        generated = tr.generated
        marks = tr.marks
        if not marks or marks[-1][1] != self._version:
            mark(tr, generated, self._version)
        tid = tr.request.trajectory_id
        self._running[tid] = tr
        self._k += tr.context_at_admit - steps
        heapq.heappush(self._heap, (steps + tr.stop_len - generated, tr.admit_seq, tid))

    def _completion(
        self, tr: Traj, generated: int, reason: FinishReason, t: float
    ) -> SimCompletion:
        cfg = self.config
        n_prior = len(tr.request.generated_token_ids)
        # Drop marks at or beyond the final length (e.g. interrupted right at admission).
        segments = tuple(m for m in tr.marks if m[0] < generated)
        if generated > n_prior and (not segments or segments[0][0] != n_prior):
            raise AssertionError("version marks must start at the first generated position")
        return SimCompletion(
            trajectory_id=tr.request.trajectory_id,
            prompt_tokens=tr.prompt_len,
            num_tokens=generated,
            finish_reason=reason,
            time_s=t,
            version_segments=segments,
            request=tr.request,
            stream_key=tr.key,
            eos_position=tr.eos_position,
            eos_token_id=cfg.eos_token_id,
            token_range=(cfg.num_special_tokens, cfg.vocab_size),
        )


def _elapsed(st: _Stretch, j: int) -> float:
    if j <= 0:
        return 0.0
    return st.c0 + st.c1 * j + st.c2 * j * (j - 1) / 2


def make_core(**kwargs: Any) -> SimEngineCore:
    """Build a core from flat keyword arguments (``SimConfig`` fields + ``instance_id``)."""
    instance_id = kwargs.pop("instance_id", "sim-0")
    version = kwargs.pop("version", 0)
    return SimEngineCore(SimConfig.from_mapping(kwargs), instance_id=instance_id, version=version)
