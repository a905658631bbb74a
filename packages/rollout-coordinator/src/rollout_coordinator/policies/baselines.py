"""The named policies: StaleFlow, its ablations, and the baselines it is compared against.

Every policy is a combination of one routing, one synchronization, one migration strategy and
one admission gate, run by the same coordinator cycle on the same engines, so a comparison
changes nothing but the decisions. All of them reserve through a staleness protocol; the
baselines' own admission rules sit on top. Every policy but ``coarse-async-drop`` and
``verl-async`` uses StaleFlow's buffers, which keep η for every trajectory.
``coarse-async-drop`` keeps η the way ROLL Flash does, by dropping what ages out of a FIFO;
``verl-async`` runs over a FIFO that keeps no bound, as verl's fully-async recipe does: its
window limits how far generation runs ahead, and a long response can still be trained more
than η versions after it started (``Policy.protocol``, ``Policy.keeps_eta``).
"""

from __future__ import annotations

import attrs

from rollout_coordinator.policies._base import (
    AdmissionGate,
    MigrationFn,
    RoutingFn,
    SyncFn,
    fields_read,
)
from rollout_coordinator.policies.admission import (
    admit_by_inflight_budget,
    admit_by_protocol,
    admit_by_verl_window,
    batch_barrier,
)
from rollout_coordinator.policies.migration import migrate_to_starving, no_migration
from rollout_coordinator.policies.routing_even import route_evenly
from rollout_coordinator.policies.routing_gain import route_by_marginal_gain
from rollout_coordinator.policies.sync_global import sync_all_on_publish, sync_all_when_drained
from rollout_coordinator.policies.sync_per_instance import sync_when_starved


@attrs.frozen(kw_only=True)
class Policy:
    name: str
    routing: RoutingFn
    sync: SyncFn
    migration: MigrationFn
    admission: AdmissionGate
    #: Rollout and training time-share the same GPUs (the simulator/app must not overlap them).
    colocated: bool = False
    #: The η this policy models; the coordinator refuses a protocol configured otherwise.
    required_eta: int | None = None
    #: Which staleness protocol it runs over: ``"buffers"`` (``StalenessProtocol``'s
    #: per-version buffers), ``"gc-fifo"`` (``GcFifo``: one FIFO, too-stale groups dropped) or
    #: ``"fifo"`` (``UnboundedFifo``: one FIFO that drops nothing and keeps no η).
    protocol: str = attrs.field(
        default="buffers", validator=attrs.validators.in_(("buffers", "gc-fifo", "fifo"))
    )
    #: A baseline models another system: it runs none of StaleFlow's own protocol mechanisms
    #: (redundant rollout, stuck-buffer resolution) in a comparison.
    baseline: bool = False
    #: Another policy whose every decision this one makes, run for run, where the two runs'
    #: configs differ in the policy's name alone (a comparison may then report that policy's
    #: runs for this one instead of running it). Stated only with a proof in the policy's
    #: docstring.
    same_decisions_as: str | None = None
    description: str = ""

    @property
    def keeps_eta(self) -> bool:
        """Whether every trajectory it trains is at most η versions stale (False: ``"fifo"``,
        whose staleness only its admission gate limits)."""
        return self.protocol != "fifo"

    @property
    def reads(self) -> frozenset[str]:
        """The :class:`~rollout_coordinator.CoordinatorConfig` fields its strategies read
        (declared on each function with ``policies._base.reads``): setting any other strategy
        field changes none of its decisions, so a caller can refuse it by name."""
        fns = (self.routing, self.sync, self.migration, self.admission)
        return frozenset().union(*(fields_read(f) for f in fns))


def sync_baseline() -> Policy:
    """**sync** — verl's synchronous PPO/GRPO trainer (η = 0, colocated).

    verl generates a whole batch with the current weights (the batch is split evenly across the
    rollout workers, each engine schedules its chunk itself), then the same GPUs compute rewards
    and train, then the new weights are loaded into every rollout engine before the next batch.
    Modeled as: a batch barrier with lag 0 (``B·n`` new trajectories admitted at once, only when
    the previous batch is fully generated and every instance serves the latest version), even
    routing with no KV gating (the engine queues what it cannot run), sync of every instance once
    drained (never interrupting a batch), no migration, ``colocated=True`` so the caller runs
    training on the rollout GPUs, not beside them.
    """
    return Policy(
        name="sync",
        baseline=True,
        routing=route_evenly,
        sync=sync_all_when_drained,
        migration=no_migration,
        admission=batch_barrier(0),
        colocated=True,
        required_eta=0,
        description=sync_baseline.__doc__ or "",
    )


def one_step_baseline() -> Policy:
    """**one-step** — verl's one-step off-policy pipeline (η = 1, disaggregated).

    Rollout GPUs generate batch k+1 with version k's predecessor weights while the trainer GPUs
    train on batch k; after each training step the weights are broadcast to every rollout
    engine, between generation calls. Modeled as: a batch barrier with lag 1 (batch j starts
    once batch j−1 is generated and the trainer has published version ≥ j−1), even routing,
    sync of every instance once drained (no interruption of a batch in generation), no
    migration.
    """
    return Policy(
        name="one-step",
        baseline=True,
        routing=route_evenly,
        sync=sync_all_when_drained,
        migration=no_migration,
        admission=batch_barrier(1),
        required_eta=1,
        description=one_step_baseline.__doc__ or "",
    )


def coarse_async_baseline() -> Policy:
    """**coarse-async** — verl fully-async / AReaL / ROLL Flash (strict staleness, coarse budget).

    These systems bound staleness with an in-flight admission budget: a new prompt is admitted
    while ``(η + v + 1)·B − (accepted + running) > 0`` (v = trainer version); generation is
    partial-rollout (an interrupted trajectory keeps its tokens and resumes at the new version);
    every rollout instance updates its weights as soon as the trainer publishes (interrupting
    running work); requests are spread evenly over the servers; nothing migrates. Modeled
    exactly so: the in-flight budget gate, even routing, greedy global sync on publish, no
    migration. η comes from the protocol config.

    Over StaleFlow's buffers the budget never binds, so it decides as ``all-vanilla`` does
    (``same_decisions_as``) wherever the two runs' configs differ in the policy alone (no batch
    redundancy, no stuck-buffer resolution: a baseline runs without them). Proof: let ``v``
    be the latest published version and ``k ≥ v`` the batches consumed (version ``v`` trains
    batch ``v − 1``). Every admitted trajectory not lost is consumed (``B·n`` a batch) or
    belongs to a group reserved in a buffer in ``[k, v + η]``, at most ``B`` groups of ``n'``
    members each: a fresh group at an instance's version ``u ≤ v`` reserves a buffer no
    later than ``u + η``. Writing ``R`` for those groups' admitted members, the budget is
    ``(η + 1)·B·n' + v·B·n − (k·B·n + R) = (η + 1 + v − k)·B·n' − R + (k − v)·B·(n' − n)``,
    while the protocol has room for at most ``(v + η − k + 1)·B·n' − R`` more trajectories at
    any version ≤ ``v``: the budget is never below it (equal at ``k = v``). Losses keep the
    inequality: a lost member gives the budget one back and the protocol at most one, and a
    group aborted whole frees its slot of ``n'`` while the budget gets back its admitted
    members, the rest having counted as room on both sides. The even router tries partials
    before new prompts and stops at the quota only after the admissions the protocol allows,
    and a refused admission changes nothing, so every route, sync and admission is the same.
    """
    return Policy(
        name="coarse-async",
        baseline=True,
        routing=route_evenly,
        sync=sync_all_on_publish,
        migration=no_migration,
        admission=admit_by_inflight_budget,
        same_decisions_as="all-vanilla",
        description=coarse_async_baseline.__doc__ or "",
    )


def coarse_async_drop_baseline() -> Policy:
    """**coarse-async-drop** — a strict-async system that keeps η by dropping (ROLL Flash style).

    The same coarse in-flight budget, even routing, greedy global sync on publish and partial
    rollout as ``coarse-async``, but with a data path that keeps η by dropping: no
    per-version buffers — every finished group joins one queue, the trainer takes the first
    ``B`` in completion order, and a group that can no longer be trained within η (its
    version ≤ ``current − η − 1``) is garbage-collected, in flight (the generated tokens are
    lost) or waiting (the stored result is discarded). That keeps η without reservations, at
    the price of the work thrown away and of a sample biased toward short responses (the long
    tail is what ages out). Modeled as: the in-flight budget gate, even routing, greedy global
    sync, no migration, over ``staleness_protocol.GcFifo``.
    """
    return Policy(
        name="coarse-async-drop",
        baseline=True,
        routing=route_evenly,
        sync=sync_all_on_publish,
        migration=no_migration,
        admission=admit_by_inflight_budget,
        protocol="gc-fifo",
        description=coarse_async_drop_baseline.__doc__ or "",
    )


def verl_async_baseline() -> Policy:
    """**verl-async** — verl's fully-async recipe (``recipe/fully_async_policy``) as it runs.

    What it models. verl splits the GPUs into a *rollouter* and a *trainer* joined by a
    message queue. The rollouter streams prompts one *sample* (a prompt and its ``n``
    responses) at a time; between two parameter syncs it starts at most
    ``⌊(1 + staleness_threshold)·B⌋`` samples, where its count restarts at each sync from the
    samples still active, cancelled-for-resume or waiting in the queue, and it keeps at most
    16 samples per rollout server in flight. Each response is sent to the least-loaded server.
    The trainer takes ``B`` finished samples from the queue in completion order (``B`` =
    ``ppo_mini_batch_size × require_batches × trigger_parameter_sync_step``: one sync per step
    here), trains, and triggers the sync: with ``partial_rollout`` the rollouter aborts every
    running request, all servers load the new weights (KV cache cleared), and the aborted
    requests resume first, keeping their tokens and their version. A finished sample enters
    the queue with the rollouter's version at that moment, and the queue refuses a sample
    only if that version is more than ``staleness_threshold`` behind the trainer's: with
    partial rollout the rollouter syncs on every publish, so its version is never far
    behind, and a long response that started many versions back is still trained. The
    window limits staleness on average, not per trajectory.

    Modeled as: the window gate
    (:func:`~rollout_coordinator.policies.admission.admit_by_verl_window`, ``s`` =
    ``verl_staleness_threshold``, η by default;
    ``verl_max_concurrent_groups_per_instance``), even routing by trajectory count, greedy
    global sync on publish (partial rollout), no migration, one FIFO that drops nothing and
    keeps no η (``staleness_protocol.UnboundedFifo``, ``protocol="fifo"``; its in-flight cap
    is set above what the window admits). Staleness is measured as everywhere, from the
    version a trajectory started at to the one that trains it, so a run shows how far past
    ``s`` its long responses go (``keeps_eta`` is False). ``coarse-async-drop`` is the variant
    that drops what would exceed η.

    What it leaves out. The trainer's wait for the rollouter to pause and for the broadcast
    is the caller's (it models the push); the queue's size cap (implied by the window within
    one sync) and the concurrency cap's count by samples (counted here as engine-held
    trajectories ÷ n) are approximated; the queue's refusal by the finishing version (which
    could only catch a sample finished during a sync), the mode without partial rollout
    (drain, then sync), validation and checkpoint pauses are not modeled.
    """
    return Policy(
        name="verl-async",
        baseline=True,
        routing=route_evenly,
        sync=sync_all_on_publish,
        migration=no_migration,
        admission=admit_by_verl_window,
        protocol="fifo",
        description=verl_async_baseline.__doc__ or "",
    )


def staleflow_policy() -> Policy:
    """**staleflow** — all three strategies: cost-model routing with θ, per-instance sync when
    starved, starving–loaded migration plus bounce; admission by the protocol alone."""
    return Policy(
        name="staleflow",
        routing=route_by_marginal_gain,
        sync=sync_when_starved,
        migration=migrate_to_starving,
        admission=admit_by_protocol,
        description=staleflow_policy.__doc__ or "",
    )


def _ablation(name: str, *, routing: bool, sync: bool, migration: bool) -> Policy:
    return Policy(
        name=name,
        routing=route_by_marginal_gain if routing else route_evenly,
        sync=sync_when_starved if sync else sync_all_on_publish,
        migration=migrate_to_starving if migration else no_migration,
        admission=admit_by_protocol,
        description=(
            f"StaleFlow ablation: routing={'cost-model' if routing else 'vanilla even split'}, "
            f"sync={'per-instance' if sync else 'vanilla greedy global'}, "
            f"migration={'on' if migration else 'vanilla none'}."
        ),
    )


def vanilla_routing() -> Policy:
    """StaleFlow with routing replaced by the even split."""
    return _ablation("vanilla-routing", routing=False, sync=True, migration=True)


def vanilla_sync() -> Policy:
    """StaleFlow with synchronization replaced by greedy global sync on publish."""
    return _ablation("vanilla-sync", routing=True, sync=False, migration=True)


def vanilla_migration() -> Policy:
    """StaleFlow with migration switched off."""
    return _ablation("vanilla-migration", routing=True, sync=True, migration=False)


def all_vanilla() -> Policy:
    """StaleFlow's protocol with all three strategies vanilla."""
    return _ablation("all-vanilla", routing=False, sync=False, migration=False)
