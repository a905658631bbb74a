"""Two upper bounds on a split's throughput: the roofline ideal and the latency-aware bound.

**Roofline ideal** (``ideal_tokens_per_s``) ``= min(rollout side, training side)``, in consumed
tokens (prompt + response) per second:

* Rollout side: every rollout instance always busy at its best throughput with no idle tail.
  An instance holding ``n`` trajectories of mean resident context ``c̄`` generates
  ``T(n) = n / τ(n, n·c̄)`` tokens/s; the best feasible ``n`` (``≤ max_running``, ``n·c̄`` within
  the KV budget) gives ``T*``. ``c̄ = E[prompt] + E[L²] / (2 E[L])`` is the time-average context
  of a trajectory that grows one token per step from its prompt to ``prompt + L``. Generated
  tokens convert to consumed tokens by ``(E[prompt] + E[L]) / E[L]``. Prefill and weight loads
  are ignored (they are not generation).
* Training side: the trainer never waits: ``B·n·(E[prompt] + E[L])`` tokens per
  ``train_seconds(tokens, Σ seq²) + push_seconds``.

**Latency-aware bound** (:func:`latency_bound`): the best an η-respecting schedule can reach
once every trajectory must also finish in time. In steady state with a step every ``S``
seconds, a trajectory admitted when version ``v`` is the latest must be trained with buffer
``v + η`` at the latest, ``η·S`` later: its ``L`` tokens need a decode step of at most
``d = η·S / L`` on average, so its instance may hold only ``n`` trajectories with
``τ(n, n·c) + n·t_p / L ≤ d`` (and within the KV budget), ``c = E[prompt] + L/2``: every
trajectory's prompt is prefilled once (``t_p`` seconds, the engine's prefill of the prompt),
which stretches the steps of its instance, and the ``n`` trajectories there start ``n / L``
new ones a step, so each token carries ``n·t_p / L`` of prefill. Give every trajectory
length its own instances at exactly that latency (a fluid relaxation: on a shared instance the
longest member sets the latency all share) and count the
instances the demand ``B·n·L / S`` tokens/s needs; ``S`` is the smallest step time at which the
rollout instances suffice and the trainer keeps up. The bound is ``B·n·(E[prompt] + E[L]) / S``.
``S`` is never below the roofline's step (the trainer's, or the batch's generation at the
instances' best rate), so the bound never exceeds the roofline ideal; nor below the step the
instances need in the same per-length accounting with no window at all. The side is
``rollout`` when ``S`` is that step (the window adds nothing: the instances' throughput binds)
and ``latency`` only when the window makes ``S`` longer. At η = 0 (generate, then
train) ``S = train + push + generation``, generation being the slowest trajectory alone (its
prompt's prefill and its decode) or the batch's work at the instances' best rate plus its
prompts' prefill, whichever is longer. It counts each prompt's first prefill, which no schedule
avoids, and ignores every other prefill (after a preemption, a move or a sync), the weight
loads of syncs, the discreteness of instances and the small KV saving of mixing lengths on one
instance: an estimate of the best schedule, not a promise. It also assumes a *steady* step time
(every batch the mean batch, every step ``S``): a schedule whose steps vary can beat it when long
responses are rare, by giving only the steps that carry them a longer interval (a batch of long
responses also trains longer). On ``examples/sim-tiny.yaml`` at η = 1 (responses up to 1 024
tokens at a 9.2 ms floor: ``S ≥ 9.4 s``) staleflow measured 1 852 tokens/s over 34 steps
against a bound of 1 373: read the bound as the steady-step limit, and a run above it as one
that exploits uneven steps. The side that sets ``S`` is named (``train``: the
trainer; ``rollout``: the instances' throughput; ``latency``: the tail against ``η·S``).

With ``trainer.stream_batch`` (:attr:`~.spec.SimSpec.stream_batch`) the trainer works on a
batch's settled groups while the rest finishes, so a response's window ends not when the step
of its last buffer starts but when only that step's per-step rest and push are left:
``(η + 1)·S − tail`` instead of ``η·S``; at η = 0 generation and the per-sample work
overlap (``S = max(train + push, generation + tail)``).

The moments and lengths come from the run's own workload stream (the first ``groups`` groups).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from staleflow_trainer.sim.spec import SimSpec
from staleflow_trainer.sim.workload import PromptStream


def _sample(spec: SimSpec, groups: int) -> tuple[np.ndarray, np.ndarray]:
    stream = PromptStream(spec)
    lens: list[int] = []
    prompts: list[int] = []
    for g in range(groups):
        d = stream.group(g)
        kept = d.response_lens[: spec.group_size]  # what a batch trains on
        lens.extend(kept)
        prompts.extend([d.prompt_len] * len(kept))
    return np.asarray(prompts, dtype=np.float64), np.asarray(lens, dtype=np.float64)


def workload_moments(spec: SimSpec, groups: int = 2048) -> dict[str, float]:
    P, L = _sample(spec, groups)
    S = P + L
    return {
        "mean_prompt": float(P.mean()),
        "mean_response": float(L.mean()),
        "mean_response_sq": float((L * L).mean()),
        "mean_seq_sq": float((S * S).mean()),
        "frac_at_cap": float((spec.max_response_len <= L).mean()),
    }


def _mean_batch(spec: SimSpec, m: dict[str, float]) -> tuple[float, float | None]:
    """(tokens, sum of squared sequence lengths) of a batch at the workload's means."""
    samples = spec.batch_size * spec.group_size
    return samples * (m["mean_prompt"] + m["mean_response"]), (
        samples * m.get("mean_seq_sq", 0.0) or None
    )


def _step_seconds(spec: SimSpec, m: dict[str, float]) -> tuple[float, float]:
    """(batch tokens, train + push seconds) of one step at the workload's means."""
    batch_tokens, seq_sq = _mean_batch(spec, m)
    return batch_tokens, spec.train_seconds(int(batch_tokens), seq_sq) + spec.push_seconds


def ideal_throughput(spec: SimSpec, moments: dict[str, float] | None = None) -> dict[str, Any]:
    """Rollout-side and training-side limits and their minimum, for ``spec``'s split."""
    m = moments if moments is not None else workload_moments(spec)
    ep, el, el2 = m["mean_prompt"], m["mean_response"], m["mean_response_sq"]
    ctx = ep + el2 / (2 * el)
    best_n, best_t = 1, 0.0
    cap = spec.kv_capacity_tokens
    cost = spec.engine.cost
    for n in range(1, spec.max_running + 1):
        kv = n * ctx
        if kv > cap:
            break
        t = cost.throughput(n, kv)
        if t > best_t:
            best_n, best_t = n, t
    instances = spec.num_instances
    per_token = (ep + el) / el
    rollout = instances * best_t * per_token
    batch_tokens, step_s = _step_seconds(spec, m)
    train = batch_tokens / step_s
    return {
        "ideal_tokens_per_s": min(rollout, train),
        "rollout_side_tokens_per_s": rollout,
        "train_side_tokens_per_s": train,
        "bound": "rollout" if rollout < train else "train",
        "instance_best_running": best_n,
        "instance_best_gen_tokens_per_s": best_t,
        "mean_resident_context": ctx,
        "batch_tokens": batch_tokens,
        "train_step_s": step_s - spec.push_seconds,
        "push_s": spec.push_seconds,
        **m,
    }


def _rate_at_latency(spec: SimSpec, d: float, ctx: float, prefill: float = 0.0) -> float:
    """Tokens/s of one instance whose trajectories may take at most ``d`` seconds a token,
    holding trajectories of context ``ctx``: the most running ``n`` that allows (0 if not even
    one). Each trajectory's first prefill, ``prefill`` seconds for each of its tokens, falls on
    the instance's steps: with ``n`` running a token takes ``τ(n, n·ctx) + n·prefill``."""
    cost = spec.engine.cost
    n_max = min(spec.max_running, int(spec.kv_capacity_tokens // max(ctx, 1.0)))

    def per_token(n: int) -> float:
        return cost.step_latency(n, n * ctx) + n * prefill

    if n_max < 1 or per_token(1) > d:
        return 0.0
    lo, hi = 1, n_max  # τ grows with n: the largest n whose token time is <= d
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if per_token(mid) <= d:
            lo = mid
        else:
            hi = mid - 1
    return lo / per_token(lo)  # T(n, n·ctx) exactly when there is no prefill


def latency_bound(spec: SimSpec, eta: int, *, groups: int = 2048, bins: int = 64) -> dict[str, Any]:
    """The latency-aware bound at staleness ``eta`` (see the module docstring)."""
    P, L = _sample(spec, groups)
    m = workload_moments(spec, groups)
    roof = ideal_throughput(spec, m)
    batch_tokens, floor_s = _step_seconds(spec, m)
    roof_s = batch_tokens / roof["rollout_side_tokens_per_s"]  # rollout at its best rate
    samples = spec.batch_size * spec.group_size
    # length classes: equal-count bins of the response lengths (their mean length and weight)
    order = np.argsort(L)
    classes = [
        (float(L[idx].mean()), float(P[idx].mean()), len(idx) / len(L))
        for idx in np.array_split(order, min(bins, len(L)))
        if len(idx)
    ]
    instances = spec.num_instances
    engine = spec.engine
    cost = engine.cost

    # streamed (trainer.stream_batch): a batch's last group may arrive until the step's
    # per-step rest and the push are all that is left of it
    tail_s = _stream_tail_s(spec, m) if spec.stream_batch else None
    if eta == 0:  # generate, then train: the slowest alone, or the batch's work spread out
        length, prompt, _ = max(classes)
        alone = engine.prefill_seconds(0, int(prompt)) + sum(
            cost.step_latency(1, prompt + i) for i in range(int(length))
        )
        # every prompt is prefilled once before its first token (mean seconds a trajectory)
        first_prefill = float(np.mean([engine.prefill_seconds(0, int(p)) for p in P]))
        spread = roof_s + samples * first_prefill / instances
        side = "latency" if alone >= spread else "rollout"
        gen = max(alone, spread)
        if tail_s is not None and floor_s >= gen + tail_s:
            return _bound_row(batch_tokens, floor_s, floor_s, "train")
        s0 = floor_s + gen if tail_s is None else gen + tail_s
        return _bound_row(batch_tokens, s0, floor_s, side)

    # each class's prompt prefill, spread over its tokens (see _rate_at_latency)
    prefill_per_token = [engine.prefill_seconds(0, int(p)) / length for length, p, _ in classes]

    def needed(s: float, window: float | None = None) -> float:
        """Instances the demand needs at step time ``s``, each length at the rate its window
        (``η·s`` unless given; streamed, one step more less its tail) allows."""
        if window is None:
            window = eta * s if tail_s is None else (eta + 1) * s - tail_s
        total = 0.0
        for (length, p, w), prefill in zip(classes, prefill_per_token, strict=True):
            rate = _rate_at_latency(spec, window / length, p + length / 2, prefill)
            if rate <= 0:
                return math.inf
            total += samples * w * length / s / rate
        return total

    # the instances' throughput in the same per-length accounting, with no window at all: the
    # step below which the rollout side cannot keep up however long the window
    rollout_s = max(roof_s, needed(1.0, math.inf) / instances)
    lo = max(floor_s, rollout_s)
    if needed(lo) <= instances * (1 + 1e-9):  # the tail fits the window: a throughput binds
        return _bound_row(batch_tokens, lo, floor_s, "train" if floor_s >= rollout_s else "rollout")
    hi = lo * 2
    while needed(hi) > instances:
        lo, hi = hi, hi * 2
        if hi > 1e9:  # pragma: no cover - an instance can always run one trajectory
            return _bound_row(batch_tokens, math.inf, floor_s, "latency")
    for _ in range(60):
        mid = (lo + hi) / 2
        if needed(mid) <= instances:
            hi = mid
        else:
            lo = mid
    return _bound_row(batch_tokens, hi, floor_s, "latency")


def _stream_tail_s(spec: SimSpec, m: dict[str, float]) -> float:
    """What is left of a streamed step once its last group is in: the per-step rest of the
    step (optimizer, offload, fixed costs) and the push."""
    batch_tokens, seq_sq = _mean_batch(spec, m)
    return spec.train_split(int(batch_tokens), seq_sq)[1] + spec.push_seconds


def _bound_row(batch_tokens: float, s: float, floor_s: float, side: str) -> dict[str, Any]:
    return {
        "latency_bound_tokens_per_s": batch_tokens / s if s > 0 else 0.0,
        "latency_bound_step_s": s,
        "train_floor_step_s": floor_s,
        "latency_bound_side": side,
    }
