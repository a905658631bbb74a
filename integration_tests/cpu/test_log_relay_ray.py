"""The run's other actors' warnings and errors reach the driver's output (``log_relay``):
each actor keeps them in its own Ray worker process, and the driver's ``WarningRelay`` fetches
them (``take_logs``) without ever waiting on an actor — one that is frozen holds only its own
lines, one that is gone is dropped. Real Ray actors; the actor classes of the deployment all
keep their lines."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from staleflow_trainer.actors.log_relay import KeepsWarnings, WarningRelay

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


class Noisy(KeepsWarnings):
    def __init__(self, name: str) -> None:
        self._keep_warnings()
        self._log = structlog.get_logger("noisy").bind(actor=name)
        self._log.warning("noisy_started", slow_s=1.5)

    def say(self, n: int) -> int:
        for k in range(n):
            self._log.info("routine", k=k)  # not relayed
            self._log.warning("noisy_warning", k=k)
        self._log.error("noisy_error", relayed_from=n)  # a name the driver sets itself
        return os.getpid()


def test_warnings_of_the_other_actors_are_relayed_without_waiting_on_any(
    ray_session: None,
) -> None:
    import ray

    actors: dict[str, Any] = {f"rollout:{i}": ray.remote(Noisy).remote(f"n{i}") for i in "ab"}
    pids = {n: ray.get(h.say.remote(2)) for n, h in actors.items()}
    os.kill(pids["rollout:b"], signal.SIGSTOP)  # frozen: its call is never answered
    try:
        relay = WarningRelay(lambda: actors, structlog.get_logger("driver"), enabled=True)
        with capture_logs() as logs:
            t0 = time.monotonic()
            relay.poll(wait_s=3.0)  # b's answer never comes: waited for 3 s, no longer
            assert time.monotonic() - t0 < 4.5
            t0 = time.monotonic()
            relay.poll()  # b's call is still out: not asked again, not waited for
            assert time.monotonic() - t0 < 1.0
        got = [(e["relayed_from"], e["event"], e["log_level"]) for e in logs]
        assert got == [
            ("rollout:a", "noisy_started", "warning"),
            ("rollout:a", "noisy_warning", "warning"),
            ("rollout:a", "noisy_warning", "warning"),
            ("rollout:a", "noisy_error", "error"),
        ], got
        assert logs[-1]["rollout_relayed_from"] == 2  # renamed by its role
        assert logs[0]["actor"] == "na" and logs[0]["slow_s"] == 1.5
    finally:
        os.kill(pids["rollout:b"], signal.SIGCONT)
    with capture_logs() as logs:
        relay.poll(wait_s=5.0)  # b answers now: its lines come
    assert {e["relayed_from"] for e in logs} == {"rollout:b"} and len(logs) == 4
    ray.kill(actors.pop("rollout:a"))
    ray.kill(actors["rollout:b"])
    with capture_logs() as logs:
        time.sleep(2.1)  # FETCH_EVERY_S
        relay.poll(wait_s=5.0)  # b is gone: dropped, nothing logged, nothing raised
    assert logs == []


def test_the_trajectory_servers_warnings_are_relayed(ray_session: None) -> None:
    """The run's trajectory-server actor (the library's, keeping its lines): a peer that sends
    a frame over the size limit before its hello is logged there, and relayed."""
    import ray

    from staleflow_trainer.actors.ts_actor import TrajectoryServerActor

    ts = ray.remote(TrajectoryServerActor).remote(token="t")
    host, port = ray.get(ts.start.remote())
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(struct.pack(">I", 1 << 30))  # a length prefix: 1 GiB
        sock.recv(1024)  # its error answer, then it closes
    relay = WarningRelay(lambda: {"trajectory_server": ts}, structlog.get_logger("d"), enabled=True)
    with capture_logs() as logs:
        relay.poll(wait_s=10.0)
    got = [(e["relayed_from"], e["event"]) for e in logs]
    assert ("trajectory_server", "frame_too_large") in got, got
    ray.kill(ts)


def test_a_dying_instances_last_error_is_relayed_before_its_process_ends(
    ray_session: None,
) -> None:
    """A rollout instance whose engine died ends its own process; the error that says why
    must reach the driver first. The instance waits (bounded) until the driver's relay has
    taken its lines: a real rollout actor with a sim engine, the trajectory server's actor."""
    import ray

    from staleflow_trainer.actors.rollout import RolloutActor
    from staleflow_trainer.actors.ts_actor import TrajectoryServerActor

    ts = ray.remote(TrajectoryServerActor).remote(token="t")
    host, port = ray.get(ts.start.remote())
    inst = ray.remote(RolloutActor).remote(
        instance_id="sim-0", backend="sim", engine_kwargs={}, ts_address=(host, port),
        ts_token="t",
    )  # fmt: skip
    ray.get(inst.start.remote())
    actors = {"rollout:sim-0": inst}
    relay = WarningRelay(lambda: actors, structlog.get_logger("driver"), enabled=True)
    relay.poll(wait_s=10.0)  # the driver has asked for its lines before: it relays them
    ray.get(inst.kill_engine.remote())  # the health check finds it within a second
    got: list[tuple[str, str]] = []
    deadline = time.monotonic() + 30
    with capture_logs() as logs:
        while time.monotonic() < deadline and ("engine_dead", "error") not in got:
            relay.poll(wait_s=0.2)
            got = [(e["event"], e["log_level"]) for e in logs]
    assert ("engine_dead", "error") in got, got
    with pytest.raises(ray.exceptions.RayActorError):  # and then its process ended
        while time.monotonic() < deadline + 30:
            ray.get(inst.stats.remote(), timeout=30)
            time.sleep(0.2)
    ray.kill(ts)


def test_every_actor_of_the_deployment_keeps_its_warnings() -> None:
    from staleflow_trainer.actors.param_host import ParamServerHost
    from staleflow_trainer.actors.reward_actor import RewardActor
    from staleflow_trainer.actors.rollout import RolloutActor
    from staleflow_trainer.actors.trainer_actor import TrainerActor
    from staleflow_trainer.actors.ts_actor import TrajectoryServerActor

    for cls in (RolloutActor, TrainerActor, RewardActor, ParamServerHost, TrajectoryServerActor):
        assert issubclass(cls, KeepsWarnings), cls
