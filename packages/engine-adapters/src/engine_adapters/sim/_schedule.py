"""The sim engine's scheduler: stretches of constant batch, boundaries, prefill planning.

:class:`Scheduler` holds the engine's state and the machinery
:class:`~engine_adapters.sim.SimEngineCore` drives (its module docstring states the rules): the
closed-form time of a stretch ``S(j) = c0 + c1·j + c2·j(j−1)/2``, the walk from boundary to
boundary, preemption, the planning of each step's chunked prefill, and weight-load ends.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import attrs

from engine_adapters._contract import FinishReason
from engine_adapters.cost_model import CostModel
from engine_adapters.errors import InvalidRequest
from engine_adapters.sim._completion import SimCompletion
from engine_adapters.sim._config import SimConfig
from engine_adapters.sim._traj import Traj, mark

# Times within this many seconds of a step boundary count as on it, so callers that add up
# step latencies themselves (in another order than the closed form) land where they meant.
EPS = 1e-9
#: (seconds, tokens, trajectories) of step-1 prefill already planned for trajectories that
#: joined the decoding batch, carried into a re-plan when a command cuts a stretch at step 0.
Carry = tuple[float, int, int]
NO_CARRY: Carry = (0.0, 0, 0)


@attrs.define(slots=True)
class Stretch:
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
    carry: Carry = NO_CARRY
    refill: bool = False  # the step-1 budget ran out with trajectories still waiting


class Scheduler:
    """State and boundary machinery of one simulated instance (see the module docstring)."""

    def __init__(self, config: SimConfig, *, instance_id: str, version: int) -> None:
        self.config = config
        self.instance_id = instance_id
        self._version = version
        self._now = 0.0
        self._steps = 0  # global steps completed at the start of the current stretch
        self._running: dict[str, Traj] = {}  # decoding; insertion order == admission order
        # two columns of ``_running``, kept in its order (every insertion and removal is made on
        # all three): the prompt length and ``generated − admit_step``, so a snapshot lists the
        # running trajectories without a per-trajectory Python step
        self._run_prompt: dict[str, int] = {}
        self._run_base: dict[str, int] = {}
        self._head: Traj | None = None  # admitted after every decoding one, prefill unfinished
        self._waiting: deque[Traj] = deque()
        self._waiting_ids: dict[str, Traj] = {}
        self._heap: list[tuple[int, int, str]] = []  # (finish step, admit seq, id)
        self._k = 0  # Σ (context_at_admit − admit_step) over decoding; kv = _k + n·steps
        self._seq = 0
        self._stretch: Stretch | None = None
        self._loading: tuple[int, float] | None = None  # (version, done at)
        self._pending_load: tuple[int, float] | None = None  # (version, seconds)
        self._paused = False
        self._outbox: list[SimCompletion] = []
        self._snapshot_seq = 0
        cfg = self.config
        self._cap_tokens = cfg.kv_capacity
        self._budget = cfg.max_num_batched_tokens
        #: The share of its own speed the instance runs at (``set_pace``; 1: all of it).
        self.pace = 1.0
        self._speeds: dict[float, tuple[CostModel, float, float, list[float]]] = {}
        self._use_speed(cfg.speed_factor)
        self.total_generated_tokens = 0
        self.preemptions = 0
        self.events = 0
        #: Context tokens prefilled (prompts and re-prefills) and the seconds that took.
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0

    def _use_speed(self, speed: float) -> None:
        """Set the step-latency model and prefill costs of an instance running at ``speed``
        (every time divided by it; one set of terms per speed, kept)."""
        terms = self._speeds.get(speed)
        if terms is None:
            cfg = self.config
            cost = cfg.cost if speed == 1.0 else cfg.cost.scaled(1.0 / speed)
            lin, quad = (c / speed for c in cfg.prefill)
            batch = [cost.batch_term(n) for n in range(min(cfg.max_running, 4096) + 1)]
            terms = self._speeds[speed] = (cost, lin, quad, batch)
        #: The instance's true step-latency model (the config's, at ``speed_factor`` × pace).
        self.cost: CostModel = terms[0]
        self._pf_lin, self._pf_quad, self._batch_terms = terms[1], terms[2], terms[3]

    def _steps_by(self, st: Stretch, delta: float) -> int:
        """Largest j <= m_end with S(j) <= delta (closed form, then exact fix-up)."""
        delta += EPS
        if delta < elapsed(st, 1):
            return 0
        a = st.c2 / 2
        b = st.c1 - a
        c = st.c0 - delta
        if a <= 0:
            j = int((delta - st.c0) / b)
        else:
            j = int((-b + math.sqrt(max(b * b - 4 * a * c, 0.0))) / (2 * a))
        j = min(max(j, 0), st.m_end)
        while j < st.m_end and elapsed(st, j + 1) <= delta:
            j += 1
        while j > 0 and elapsed(st, j) > delta:
            j -= 1
        return j

    def _position(self, now: float) -> tuple[int, bool]:
        """(global steps completed by ``now``, whether ``now`` is exactly a step boundary)."""
        st = self._stretch
        if st is None:
            return self._steps, True
        j = self._steps_by(st, now - st.t0)
        return self._steps + j, abs(st.t0 + elapsed(st, j) - now) <= EPS

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
                self._boundary(now, NO_CARRY)
            return
        steps_now, on_boundary = self._position(now)
        self._cap(steps_now - self._steps + (0 if on_boundary else 1))
        self._advance(now)

    def _advance(self, t: float) -> None:
        if t < self._now:
            raise InvalidRequest(
                f"time went backwards: {t!r} < {self._now!r} on {self.instance_id!r}", field="now"
            )
        limit = t + EPS
        while True:
            loading = self._loading
            if loading is not None:
                te = loading[1]
                if te > limit:
                    break
                self.events += 1
                self._finish_load(loading[0])
                self._boundary(te, NO_CARRY)
                continue
            st = self._stretch
            if st is None:
                break
            j = st.m_end
            # inlined elapsed(st, j): this loop is the simulator's hot path
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
                self._boundary(te, NO_CARRY)
        self._now = t

    def _commit_prefill(self, st: Stretch, j: int) -> None:
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
        self._run_prompt.clear()
        self._run_base.clear()
        self._heap.clear()
        self._k = 0

    def _kv_boundary(self, st: Stretch, t: float) -> bool:
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
        prompts, bases = self._run_prompt, self._run_base
        while n and k + n * steps + n > cap:
            tid, tr = running.popitem()
            prompts.popitem()
            bases.popitem()
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
        st.carry = NO_CARRY
        st.refill = False
        return True

    def _batch_term(self, n: int) -> float:
        terms = self._batch_terms
        if n < len(terms):
            return terms[n]
        return self.cost.batch_term(n)

    def _chunk_seconds(self, start: int, count: int) -> float:
        return self._pf_lin * count + self._pf_quad * (count * start + count * (count - 1) / 2)

    def _boundary(self, t: float, carry: Carry) -> None:
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
            del self._run_prompt[tid]
            del self._run_base[tid]
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
            self._run_prompt.popitem()
            self._run_base.popitem()
            self._k -= tr.context_at_admit - tr.admit_step
            tr.generated += steps - tr.admit_step
            self._waiting.appendleft(tr)
            self._waiting_ids[tid] = tr
            n -= 1
            kv = self._k + n * steps
        st = Stretch(t0=t, n=0, kv0=0, c0=0.0, c1=0.0, c2=0.0, m_end=0, carry=carry)
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

    def _plan(self, st: Stretch) -> None:
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
        self._run_prompt[tid] = tr.prompt_len
        self._run_base[tid] = generated - steps
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


def elapsed(st: Stretch, j: int) -> float:
    if j <= 0:
        return 0.0
    return st.c0 + st.c1 * j + st.c2 * j * (j - 1) / 2
