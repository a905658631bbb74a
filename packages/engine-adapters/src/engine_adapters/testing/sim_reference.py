"""A naive per-step reference of the sim engine's scheduling rules.

It loops over every decode step, so it is slow but obviously follows the rules stated in
``engine_adapters.sim._core``; the closed-form core must agree with it exactly.
"""

from __future__ import annotations

from collections import deque

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


def run_reference(cfg: SimConfig, trajs: list[RefTraj]) -> tuple[dict[str, float], int]:
    """Finish time of every trajectory and the number of preemptions."""
    pending = deque(sorted(trajs, key=lambda t: t.arrive))
    waiting: deque[RefTraj] = deque()
    running: list[RefTraj] = []
    t = 0.0
    preemptions = 0
    finish: dict[str, float] = {}
    cap = cfg.kv_capacity_tokens
    while pending or waiting or running:
        while pending and pending[0].arrive <= t:
            waiting.append(pending.popleft())
        for tr in [r for r in running if r.generated == r.stop_len]:
            running.remove(tr)
            finish[tr.tid] = t
        kv = sum(r.prompt_len + r.generated for r in running)
        preempted = False
        while running and kv + len(running) > cap:
            tr = running.pop()
            waiting.appendleft(tr)
            preemptions += 1
            preempted = True
            kv = sum(r.prompt_len + r.generated for r in running)
        prefill = 0.0
        if not preempted:
            while waiting and len(running) < cfg.max_running:
                context = waiting[0].prompt_len + waiting[0].generated
                if kv + context + len(running) + 1 > cap:
                    break
                tr = waiting.popleft()
                running.append(tr)
                prefill += cfg.prefill_s_per_token * context
                kv += context
        if not running:
            if not pending:
                break
            t = max(t, pending[0].arrive)
            continue
        t += prefill + cfg.cost.step_latency(len(running), kv)
        for r in running:
            r.generated += 1
    return finish, preemptions
