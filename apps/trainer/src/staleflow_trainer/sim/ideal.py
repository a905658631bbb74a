"""The physical throughput limit of a disaggregated split (issue 7's ``ideal_tokens_per_s``).

``ideal = min(rollout side, training side)``, in consumed tokens (prompt + response) per second:

* Rollout side: every rollout instance always busy at its best throughput with no idle tail.
  An instance holding ``n`` trajectories of mean resident context ``c̄`` generates
  ``T(n) = n / τ(n, n·c̄)`` tokens/s; the best feasible ``n`` (``≤ max_running``, ``n·c̄`` within
  the KV budget) gives ``T*``. ``c̄ = E[prompt] + E[L²] / (2 E[L])`` is the time-average context
  of a trajectory that grows one token per step from its prompt to ``prompt + L``. Generated
  tokens convert to consumed tokens by ``(E[prompt] + E[L]) / E[L]``. Prefill and weight loads
  are ignored (they are not generation).
* Training side: the trainer never waits: ``B·n·(E[prompt] + E[L])`` tokens per
  ``train_seconds(tokens) + push_seconds``.

The moments come from the run's own workload stream (the first ``groups`` groups).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from staleflow_trainer.sim.spec import SimSpec
from staleflow_trainer.sim.workload import PromptStream


def workload_moments(spec: SimSpec, groups: int = 2048) -> dict[str, float]:
    stream = PromptStream(spec)
    lens: list[int] = []
    prompts: list[int] = []
    for g in range(groups):
        d = stream.group(g)
        kept = d.response_lens[: spec.group_size]  # what a batch trains on
        lens.extend(kept)
        prompts.extend([d.prompt_len] * len(kept))
    L = np.asarray(lens, dtype=np.float64)
    P = np.asarray(prompts, dtype=np.float64)
    return {
        "mean_prompt": float(P.mean()),
        "mean_response": float(L.mean()),
        "mean_response_sq": float((L * L).mean()),
        "frac_at_cap": float((spec.max_response_len <= L).mean()),
    }


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
    batch_tokens = spec.batch_size * spec.group_size * (ep + el)
    step_s = spec.train_seconds(int(batch_tokens)) + spec.push_seconds
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
