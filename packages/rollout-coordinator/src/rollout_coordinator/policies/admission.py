"""Admission gates: how many *new* trajectories a policy lets in this cycle.

Every policy still reserves each new trajectory through the staleness protocol; the gate is
the baseline's own, coarser admission rule on top of it.

* :func:`admit_by_protocol` — StaleFlow: no extra limit; the protocol's per-trajectory
  admission check is the only gate.
* :func:`admit_by_inflight_budget` — verl fully-async / AReaL / ROLL Flash: admit new prompts
  while fewer than ``(η + 1)·B`` groups are ahead of training, counted in trajectories
  (``B·n'`` per batch, ``n' = n + group_redundancy``): ``(η + 1)·B·n' + v·B·n − (admitted −
  lost)`` > 0 after ``v`` trained batches (each consumed ``B·n``).
* :func:`admit_by_verl_window` — verl's fully-async rollouter: between two parameter syncs it
  starts at most ``⌊(1 + s)·B⌋`` groups (``s`` = ``verl_staleness_threshold``, η by default),
  counting the groups still in flight or finished-but-unconsumed when the window opened, and
  keeps at most ``verl_max_concurrent_groups_per_instance`` groups per instance in flight.
  Whole groups only (``n'`` trajectories each: the surplus members count too).
* :func:`batch_barrier` ``(lag)`` — verl synchronous (lag 0) and one-step off-policy (lag 1):
  a batch of exactly ``B·n'`` new trajectories (``B`` whole groups) is admitted at once, only
  when the previous batch's generation is over (every instance idle, nothing partial queued,
  every instance serving the latest version) and the trainer is at most ``lag`` batches behind.
"""

from __future__ import annotations

import attrs

from rollout_coordinator.policies._base import AdmissionGate, CycleView, GateState, reads


def admit_by_protocol(view: CycleView, state: GateState) -> tuple[int | None, GateState]:
    return None, state


def admit_by_inflight_budget(view: CycleView, state: GateState) -> tuple[int | None, GateState]:
    # (η + 1)·B groups of n' members ahead of training: what is admitted and not lost, less
    # the v·B·n trajectories the v trained batches consumed
    ahead = (view.eta + 1) * view.batch_size * view.members
    consumed = view.latest_version * view.batch_size * view.group_size
    return max(0, ahead + consumed - (view.admitted_total - view.lost_total)), state


@reads("verl_staleness_threshold", "verl_max_concurrent_groups_per_instance")
def admit_by_verl_window(view: CycleView, state: GateState) -> tuple[int | None, GateState]:
    """verl fully-async's admission (see the module docstring), in trajectories.

    The window opens when version ``v`` is published: verl resets its count of started
    samples to what is in flight or queued then, ``admitted − lost − v·B·n`` (``v`` batches are
    consumed by then), and adds every group started since (``n'`` samples each). Work lost
    later in the window (dropped for staleness) does not free room until the next window.
    """
    n = view.members  # a group starts n' trajectories; a trained batch consumed B·n of them
    consumed = view.latest_version * view.batch_size * view.group_size
    s = view.config.verl_staleness_threshold
    s = float(view.eta) if s is None else s  # the coordinator refuses both None
    if state.window_version != view.latest_version:
        state = attrs.evolve(state, window_version=view.latest_version, window_lost=view.lost_total)
    window = int((1.0 + s) * view.batch_size) * n
    budget = window + consumed + state.window_lost - view.admitted_total
    held = sum(i.n_running + i.waiting for i in view.instances.values())
    room = view.config.verl_max_concurrent_groups_per_instance * n * len(view.instances) - held
    quota = max(0, min(budget, room))
    return quota - quota % n, state


def batch_barrier(lag: int) -> AdmissionGate:
    def gate(view: CycleView, state: GateState) -> tuple[int | None, GateState]:
        if state.remaining > 0:
            return state.remaining, state
        if state.batches_started > view.latest_version + lag:
            return 0, state  # the trainer has not caught up
        if view.queue.min_partial_version() is not None:
            return 0, state  # previous batch still has unfinished partials
        for inst in view.instances.values():
            if (
                inst.syncing
                or inst.n_running
                or inst.waiting
                or inst.version != view.latest_version
            ):
                return 0, state
        per_batch = view.batch_size * view.members  # B whole groups of n' members
        return per_batch, attrs.evolve(
            state, batches_started=state.batches_started + 1, remaining=per_batch
        )

    gate.__name__ = f"batch_barrier_lag{lag}"
    return gate
