"""The libraries composed without the app: the trajectory server's own queue, read with
``queue_view``, fed to the real coordinator over the real staleness protocol.

The router stops its scan after ``route_miss_limit`` consecutive trajectories it could not
place, and fresh groups that no buffer admits are such misses. A group the protocol admitted
in part (one member routed, the others never) holds a slot in the buffer the trainer waits
for; the trajectory server serves its never-routed members before every fresh group, so the
scan reaches them and the buffer completes.
"""

from __future__ import annotations

from rollout_coordinator import QueuedTrajectory, QueueView, Route
from rollout_coordinator.testing import make, snap
from trajectory_server import SamplingParams, TrajectoryStore


def _view(store: TrajectoryStore) -> QueueView:
    return QueueView(
        [
            QueuedTrajectory(
                trajectory_id=e.trajectory_id,
                group_id=e.group_id,
                v_traj=e.v_traj,
                prompt_len=e.prompt_len,
                generated_len=e.generated_len,
            )
            for e in store.queue_view()
        ]
    )


def test_the_store_queue_lets_the_router_complete_a_partly_admitted_group() -> None:
    coord, proto, clock = make(batch=2, group=2, eta=0, instances=[("a", 0)], route_miss_limit=2)
    store = TrajectoryStore()
    for gid in ("g1", "ga", "gb", "gz"):
        store.submit_group(gid, [1] * 8, 2, sampling=SamplingParams(max_new_tokens=16))

    # the first cycle sees g1 and gz/0 only (say the rest arrived later): buffer 0 is full,
    # gz admitted in part
    first = [i for i in _view(store).items if i.trajectory_id in ("g1/0", "g1/1", "gz/0")]
    cmds = coord.step([snap("a", t=0.0)], QueueView(first), now=0.0)
    assert sorted(c.trajectory_id for c in cmds if isinstance(c, Route)) == [
        "g1/0",
        "g1/1",
        "gz/0",
    ]
    for c in cmds:
        assert isinstance(c, Route)
        store.route(c.instance_id, [c.trajectory_id], c.version)
    assert proto.buffer_fill(0).free == 0

    # gz/1 comes first although ga and gb were queued before it, and a restored store agrees
    order = [e.trajectory_id for e in store.queue_view()]
    assert order == ["gz/1", "ga/0", "ga/1", "gb/0", "gb/1"]
    restored = TrajectoryStore.from_dict(store.to_dict())
    assert [e.trajectory_id for e in restored.queue_view()] == order

    clock.t = 1.0
    cmds = coord.step([], _view(restored), now=1.0)
    assert [c.trajectory_id for c in cmds if isinstance(c, Route)] == ["gz/1"]

    # in first-in first-out order the scan stops on ga and gb, and gz/1 is never reached
    fifo = sorted(_view(restored).items, key=lambda i: (i.group_id == "gz", i.trajectory_id))
    coord2, _, clock2 = make(batch=2, group=2, eta=0, instances=[("a", 0)], route_miss_limit=2)
    coord2.step([snap("a", t=0.0)], QueueView(first), now=0.0)
    clock2.t = 1.0
    cmds = coord2.step([], QueueView(fifo), now=1.0)
    assert not [c for c in cmds if isinstance(c, Route)]
