"""Faults, randomized and at scale, on the simulator (the control core, sim engines, virtual
time): random instance deaths and restarts, random trainer crashes that restart the app from
its last checkpoint. The ledger is checked after every fault and at the end (every admitted
trajectory consumed, in flight or dropped with a reason, agreeing with the protocol; consumed
staleness <= eta).

The full soak (10,000 steps x 128 instances) is ``benchmarks/soak_sim.py``; the last test
here is its short version.
"""

from __future__ import annotations

import pytest

from staleflow_trainer.control.ledger import Where
from staleflow_trainer.sim.faults import FaultPlan, FaultySimulation, faulty_config

pytestmark = [pytest.mark.sim, pytest.mark.fault]


def _run(cfg, plan):  # type: ignore[no-untyped-def]
    sim = FaultySimulation(cfg, plan)
    sim.run()
    return sim


def _assert_balanced(sim: FaultySimulation) -> dict[str, int]:
    counts = sim.check()  # raises on a lost / double-counted trajectory or staleness > eta
    p = sim.cfg.protocol
    hist = sim.core.protocol.stats().staleness_histogram
    steps = sim.cfg.trainer.steps
    assert sum(hist.values()) == counts["consumed"] == steps * p.batch_size * p.group_size
    assert max(int(s) for s in hist) <= int(p.eta)
    assert sum(sim.core.ledger.dropped_reasons.values()) >= counts["dropped"]  # with reasons
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_instance_deaths_and_restarts(seed: int) -> None:
    sim = _run(
        faulty_config(instances=8, steps=60, seed=seed, response_len_median=128),
        FaultPlan(seed=seed, instance_death_rate=1.0, down_s=2.0, min_alive=2),
    )
    assert sim.faults["instance_deaths"] >= 10
    assert sim.faults["instance_restarts"] >= sim.faults["instance_deaths"] - 6
    assert sim.faults["lost_requeued"] > 0  # deaths hit instances mid-generation
    _assert_balanced(sim)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trainer_crashes_resume_from_checkpoints(seed: int) -> None:
    sim = _run(
        faulty_config(instances=8, steps=60, seed=seed, response_len_median=64,
                      checkpoint_every=3),
        FaultPlan(seed=seed, instance_death_rate=0.3, down_s=3.0, trainer_crash_rate=0.1),
    )  # fmt: skip
    assert sim.faults["trainer_crashes"] >= 1
    assert sim.steps_trained == sim.cfg.trainer.steps + sim.faults["steps_rolled_back"]
    _assert_balanced(sim)


def test_faults_with_redundancy_eta_2_and_aborts() -> None:
    cfg = faulty_config(
        instances=6, steps=50, eta=2, response_len_median=96, checkpoint_every=4
    ).evolve(
        "protocol.batch_redundancy=1", "protocol.group_redundancy=2", "protocol.stuck_threshold=2"
    )
    sim = _run(
        cfg,
        FaultPlan(
            seed=7, instance_death_rate=0.8, down_s=2.0, trainer_crash_rate=0.05, min_alive=2
        ),
    )
    counts = _assert_balanced(sim)
    assert counts["dropped"] > 0  # redundancy surplus was aborted, with reasons
    assert sim.faults["instance_deaths"] > 0 and sim.faults["trainer_crashes"] > 0


def test_the_check_catches_a_lost_trajectory() -> None:
    """The ledger check can fail: losing a finished trajectory (dropping it in the ledger
    while the protocol still holds it) is reported, naming it."""
    sim = _run(faulty_config(instances=4, steps=5), FaultPlan(seed=0))
    live = next(e for e in sim.core.ledger.live() if e.where is Where.FINISHED)
    live.where = Where.DROPPED
    with pytest.raises(AssertionError, match=live.tid):
        sim.check()


def test_soak_short_128_instances() -> None:
    """The soak's short version: 128 instances, 150 steps, deaths + restarts + crashes, the
    full ledger check after every fault."""
    sim = _run(
        faulty_config(instances=128, steps=150, batch=8, group=4, eta=2,
                      response_len_median=128, checkpoint_every=20),
        FaultPlan(seed=0, instance_death_rate=2.0, down_s=5.0, trainer_crash_rate=0.01),
    )  # fmt: skip
    assert sim.faults["instance_deaths"] >= 50
    assert sim.faults["ledger_checks"] >= sim.faults["instance_deaths"]
    _assert_balanced(sim)


def test_deaths_after_finished_work_the_core_had_not_seen() -> None:
    """Engines killed right after they finished work, before their report reached the core
    (the store holds the output; a real instance killed between writing its finishes to the
    trajectory server and its poll answer): each loss carries those trajectories, which go
    on to reward exactly once — none is routed again."""
    from staleflow_trainer.control import effects as fx
    from staleflow_trainer.control.events import Outcome

    class Watched(FaultySimulation):
        def __init__(self, cfg, plan):  # type: ignore[no-untyped-def]
            self.finished_at_loss: set[str] = set()
            self.routed_again: list[str] = []
            super().__init__(cfg, plan)

        def _lose_engine(self, iid: str, *, finished: list[Outcome] | None = None) -> None:
            self.finished_at_loss |= {o.trajectory_id for o in finished or ()}
            super()._lose_engine(iid, finished=finished)

        def apply(self, effects: list[fx.Effect]) -> None:
            for e in effects:
                if isinstance(e, fx.Route):
                    self.routed_again += [t for t in e.trajectory_ids if t in self.finished_at_loss]
            super().apply(effects)

    sim = Watched(
        faulty_config(instances=8, steps=60, seed=0, response_len_median=128),
        FaultPlan(seed=0, instance_death_rate=1.0, down_s=2.0, min_alive=2, death_after_finish=0.7),
    )
    sim.run()
    assert sim.faults["deaths_after_finish"] >= 10
    assert sim.faults["instance_deaths"] > sim.faults["deaths_after_finish"]  # others at once
    assert sim.finished_at_loss and sim.routed_again == []
    # every one still running in the core when its engine died went on to reward
    assert 0 < sim.core.counters["lost_finished"] <= sim.faults["lost_finished"]
    assert sim.core.counters["late_outcomes"] == 0
    _assert_balanced(sim)


def test_only_the_first_replace_lost_losses_are_replaced() -> None:
    """``rollout.replace_lost`` bounds the replacements as in the Ray deployment: the first
    two losses come back, the later ones do not, and the run finishes on what is left."""
    sim = _run(
        faulty_config(instances=8, steps=40, seed=0, response_len_median=64, replace_lost=2),
        FaultPlan(seed=0, instance_death_rate=0.5, down_s=2.0, min_alive=2),
    )
    deaths = sim.faults["instance_deaths"]
    assert deaths > 2
    assert sim.faults["replacements_started"] == sim.faults["instance_restarts"] == 2
    assert len(sim.engines) == 8 - deaths + 2
    _assert_balanced(sim)
