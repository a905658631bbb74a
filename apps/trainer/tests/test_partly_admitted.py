"""A group the protocol admitted in part: its never-routed members are served before fresh
groups once the trainer waits for its buffer.

The router's scan stops after ``route_miss_limit`` consecutive trajectories that found no
instance. Fresh groups that no buffer admits are such misses, so never-routed members queued
behind enough of them were never reached: their group kept its slot in the buffer the trainer
waits for, and the run stopped for good (seen in the simulator: ``integration_tests/cpu/
test_closed_loop_sim.py::test_a_partly_admitted_group_in_the_buffer_due_is_completed``).
"""

from __future__ import annotations

from rollout_coordinator import CoordinatorConfig, QueueView, Route
from rollout_coordinator.testing import make, snap
from staleflow_trainer.control import ControlCore, CoreConfig
from staleflow_trainer.control.events import Cycle, InstanceJoined, Reported
from staleflow_trainer.control.ledger import Ledger
from staleness_protocol import ProtocolConfig


def _ids(ledger: Ledger) -> list[str]:
    return [q.trajectory_id for q in ledger.queue_items()]


def test_a_promoted_group_goes_before_fresh_groups_and_survives_a_round_trip() -> None:
    led = Ledger()
    for k, gid in enumerate(("ga", "gb", "gc")):
        led.add_group(gid, row=k, members=2, prompt_len=8)
    led.run("gc/0", "i0", v_traj=0)  # gc partly admitted, behind two fresh groups
    assert _ids(led) == ["ga/0", "ga/1", "gb/0", "gb/1", "gc/1"]
    assert led.partly_admitted() == ["gc"]

    led.promote("gc")
    assert _ids(led) == ["gc/1", "ga/0", "ga/1", "gb/0", "gb/1"]
    assert led.to_dict()["new"][0] == "gc/1"  # older readers see the same order
    assert led.partly_admitted() == []
    assert led.new_queued == 5 and led.level_counts() == {"new": 5}

    again = Ledger.from_dict(led.to_dict())
    assert _ids(again) == _ids(led)
    assert again.to_dict() == led.to_dict()

    led.run("gc/1", "i0", v_traj=0)  # routed: it leaves the promoted part
    led.run("ga/0", "i1", v_traj=0)
    assert _ids(led) == ["ga/1", "gb/0", "gb/1"]
    assert led.partly_admitted() == ["ga"]
    led.run("ga/1", "i1", v_traj=0)
    assert led.partly_admitted() == []  # nothing of ga waits any more


def test_a_restored_ledger_promotes_in_the_same_order() -> None:
    led = Ledger()
    for k, gid in enumerate(("ga", "gb")):
        led.add_group(gid, row=k, members=2, prompt_len=8)
    led.run("gb/0", "i0", v_traj=0)  # admitted in this order: gb, then ga
    led.run("ga/0", "i0", v_traj=0)
    again = Ledger.from_dict(led.to_dict())
    assert again.partly_admitted() == led.partly_admitted() == ["gb", "ga"]


def test_the_router_reaches_a_promoted_group_but_not_one_behind_refused_fresh_groups() -> None:
    """The real coordinator and protocol: the buffer holds its last group, ``gz``, with one
    member admitted; two fresh groups queued before gz's other member find no slot."""
    coord, proto, clock = make(batch=2, group=2, eta=0, instances=[("a", 0)], route_miss_limit=2)
    led = Ledger()
    for k, gid in enumerate(("g1", "ga", "gb", "gz")):
        led.add_group(gid, row=k, members=2, prompt_len=8)
    first = [q for q in led.queue_items() if q.trajectory_id in ("g1/0", "g1/1", "gz/0")]
    cmds = coord.step([snap("a", t=0.0)], QueueView(first), now=0.0)
    for c in cmds:
        assert isinstance(c, Route)
        led.run(c.trajectory_id, c.instance_id, v_traj=c.version)
    assert sorted(c.trajectory_id for c in cmds) == ["g1/0", "g1/1", "gz/0"]
    assert proto.buffer_fill(0).free == 0
    assert led.partly_admitted() == ["gz"]

    clock.t = 1.0
    cmds = coord.step([], QueueView(led.queue_items()), now=1.0)
    assert not [c for c in cmds if isinstance(c, Route)]  # gz/1 is never reached

    led.promote("gz")
    clock.t = 2.0
    cmds = coord.step([], QueueView(led.queue_items()), now=2.0)
    assert [c.trajectory_id for c in cmds if isinstance(c, Route)] == ["gz/1"]


def test_promoted_members_leave_the_queue_like_any_other() -> None:
    led = Ledger()
    for k, gid in enumerate(("ga", "gb")):
        led.add_group(gid, row=k, members=3, prompt_len=8)
    led.run("gb/0", "i0", v_traj=0)
    led.promote("gb")
    assert led.drop("gb/1", "filtered") is not None
    led.set_v_traj("gb/2", 0)  # a held route whose sync failed: queued as a partial
    assert _ids(led) == ["gb/2", "ga/0", "ga/1", "ga/2"]
    assert led.to_dict()["promoted"] == []
    assert led.promotions == 1


def test_a_state_saved_before_promotion_existed_still_promotes() -> None:
    led = Ledger()
    for k, gid in enumerate(("ga", "gb")):
        led.add_group(gid, row=k, members=2, prompt_len=8)
    led.run("gb/0", "i0", v_traj=0)
    old = led.to_dict()
    for key in ("promoted", "partly", "promotions"):
        del old[key]
    again = Ledger.from_dict(old)
    assert _ids(again) == ["ga/0", "ga/1", "gb/1"]
    assert again.partly_admitted() == ["gb"]  # rebuilt from the entries
    again.promote("gb")
    assert _ids(again) == ["gb/1", "ga/0", "ga/1"]


def _core_after_one_cycle(eta: int) -> ControlCore:
    """Three idle instances that run one trajectory each: one cycle admits a whole group
    and one member of the next."""
    cfg = CoreConfig(
        protocol=ProtocolConfig(batch_size=2, group_size=2, eta=eta),
        coordinator=CoordinatorConfig(policy="staleflow", route_max_concurrency=1),
        steps=4,
        dynamic_sampling=False,
        stuck_after_s=1.0,
        sync_retries=3,
        rows=20,
    )
    core = ControlCore(cfg, prompt_len=lambda row: 8)
    iids = ("i0", "i1", "i2")
    for iid in iids:
        core.handle(InstanceJoined(at=0.0, instance_id=iid, kv_capacity_tokens=10_000, version=0))
    for iid in iids:
        core.handle(Reported(at=0.5, instance_id=iid, outcomes=[], snapshot=snap(iid, t=0.5)))
    core.handle(Cycle(at=0.5))
    return core


def test_the_core_promotes_a_partly_admitted_group_only_in_the_buffer_due() -> None:
    # eta 0: every group reserves the buffer the trainer takes next
    core = _core_after_one_cycle(eta=0)
    (partly,) = core.ledger.partly_admitted()
    assert core.protocol.group(partly).buffer == core.protocol.next_buffer
    core.handle(Cycle(at=1.0))
    assert core.ledger.partly_admitted() == []
    assert core.ledger.to_dict()["promoted"] == [f"{partly}/1"]

    # eta 1: fresh groups reserve the later buffer, which the trainer does not wait for yet
    core = _core_after_one_cycle(eta=1)
    (partly,) = core.ledger.partly_admitted()
    assert core.protocol.group(partly).buffer == core.protocol.next_buffer + 1
    core.handle(Cycle(at=1.0))
    assert core.ledger.partly_admitted() == [partly]
    assert core.ledger.to_dict()["promoted"] == []
