"""A naive per-step reference of the sim engine's scheduling rules.

It loops over every step, so it is slow but obviously follows the rules stated in
``engine_adapters.sim._core`` (decode steps, KV-budget preemption, chunked prefill under the
per-step token budget, the quadratic attention term, the speed factor, pace changes); the
closed-form core must agree with it exactly.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence

import attrs

from engine_adapters.sim import SimConfig


@attrs.define
class RefTraj:
    tid: str
    arrive: float
    prompt_len: int
    stop_len: int
    generated: int = 0
    finish: float | None = None
    prefilled: int = 0

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated


def run_reference(
    cfg: SimConfig, trajs: list[RefTraj], paces: Sequence[tuple[float, float]] = ()
) -> tuple[dict[str, float], int]:
    """Finish time of every trajectory and the number of preemptions. ``paces``: ``(time,
    pace)`` changes in time order (``SimEngineCore.set_pace``); a step runs at the pace of the
    last change made at or before its start."""
    change_at = [c for c, _ in paces]
    pending = deque(sorted(trajs, key=lambda t: t.arrive))
    waiting: deque[RefTraj] = deque()
    running: list[RefTraj] = []  # decoding, in admission order
    head: RefTraj | None = None  # admitted last, prefill unfinished
    t = 0.0
    preemptions = 0
    finish: dict[str, float] = {}
    cap = cfg.kv_capacity
    budget = math.inf if cfg.max_num_batched_tokens is None else cfg.max_num_batched_tokens
    cost = cfg.cost
    speed = cfg.speed_factor
    while pending or waiting or running or head:
        while pending and pending[0].arrive <= t:
            waiting.append(pending.popleft())
        for tr in [r for r in running if r.generated == r.stop_len]:
            running.remove(tr)
            finish[tr.tid] = t
        kv = sum(r.context for r in running)
        head_kv = head.context + 1 if head is not None else 0  # context + its first token
        preempted = False
        while running and kv + head_kv + len(running) > cap:
            preemptions += 1
            preempted = True
            if head is not None:
                head.prefilled = 0
                waiting.appendleft(head)
                head, head_kv = None, 0
                continue
            waiting.appendleft(running.pop())
            kv = sum(r.context for r in running)
        prefill = 0.0
        head_chunk = 0
        if not preempted:
            left = budget - len(running)
            if head is not None:
                rest = head.context - head.prefilled
                if rest <= left:
                    prefill += cfg.prefill_seconds(head.prefilled, rest)
                    left -= rest
                    running.append(head)
                    kv += head.context
                    head, head_kv = None, 0
                else:
                    head_chunk = int(left)
                    prefill += cfg.prefill_seconds(head.prefilled, head_chunk)
                    left = 0
            while waiting and left > 0 and head is None and len(running) < cfg.max_running:
                context = waiting[0].context
                if kv + context + len(running) + 1 > cap:
                    break
                tr = waiting.popleft()
                if context <= left:
                    prefill += cfg.prefill_seconds(0, context)
                    left -= context
                    running.append(tr)
                    kv += context
                else:
                    head, head_kv = tr, context + 1
                    tr.prefilled = 0
                    head_chunk = int(left)
                    prefill += cfg.prefill_seconds(0, head_chunk)
                    left = 0
        if not running and head is None:
            if not pending:
                break
            t = max(t, pending[0].arrive)
            continue
        i = bisect.bisect_right(change_at, t)
        pace = paces[i - 1][1] if i else 1.0
        t += (prefill + cost.step_latency(len(running), kv) / speed) / pace
        for r in running:
            r.generated += 1
        if head is not None:
            head.prefilled += head_chunk
    return finish, preemptions
