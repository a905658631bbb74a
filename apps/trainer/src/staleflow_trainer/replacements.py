"""New rollout instances in place of lost ones (``rollout.replace_lost``), started by the driver.

The control process loses an instance when its actor or its engine dies, or when it hangs past
``coordinator.call_timeout_s`` or ``coordinator.sync_timeout_s``: what the trajectory server
held there goes back to the queue and the run goes on with one instance fewer. With
``rollout.replace_lost: k`` the driver starts a new instance for each of the first ``k`` losses
of the run. It kills the lost actor (a hung one may still be there) and starts a fresh rollout
actor on its placement-group bundle, whose resources that frees; the new actor starts its
engine, pulls the latest published version from the parameter server and joins the control
loop at its next cycle, under a new id — the steps of ``Deployment.add_instance``, taken here
one at a time between the driver's polls, so records keep flowing while an engine starts.

A replacement that fails, or has not joined within ``timeout_s`` (the deployment's start-up
limit), is killed and logged with the reason (for a timeout, what the cluster lacks); it counts
against the limit and the run goes on without it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import attrs
import structlog

from staleflow_trainer.actors.liveness import kill_actor
from staleflow_trainer.prepare import missing_resources

log = structlog.get_logger(__name__)


@attrs.define
class _Starting:
    """One replacement under way: ``stage`` is the call ``ref`` answers."""

    lost: str
    instance_id: str
    handle: Any
    ref: Any
    stage: str  # "start", then "sync", then "join"
    deadline: float
    kv_capacity_tokens: int = 0
    version: int = 0


class Replacer:
    """Replaces lost instances of ``dep`` (a ``Deployment``), at most ``limit`` in its life."""

    def __init__(self, dep: Any, limit: int, timeout_s: float) -> None:
        self.dep = dep
        self.limit = limit
        self.timeout_s = timeout_s
        self.started = 0
        self.replaced: dict[str, str] = {}  # lost id -> the instance that joined in its place
        self.not_replaced: list[str] = []  # lost beyond the limit, or their replacement failed
        self._seen: set[str] = set()
        self._starting: list[_Starting] = []

    def update(self, lost: Iterable[str]) -> None:
        """Start a replacement for each instance in ``lost`` not seen before, while the limit
        allows, then move every replacement under way on by what has answered (no waiting)."""
        for iid in lost:
            if iid in self._seen:
                continue
            self._seen.add(iid)
            handle = self.dep.rollouts.pop(iid, None)
            if handle is not None:
                kill_actor(handle)  # a hung actor may still hold its bundle
            if self.started >= self.limit:
                self.not_replaced.append(iid)
                log.warning("instance_not_replaced", lost=iid, limit=self.limit,
                            hint="rollout.replace_lost")  # fmt: skip
                continue
            self.started += 1
            new_id, new = self.dep.new_rollout(bundle_of=iid)
            log.info("instance_replacing", lost=iid, instance=new_id)
            self._starting.append(_Starting(
                lost=iid, instance_id=new_id, handle=new, ref=new.start.remote(), stage="start",
                deadline=time.monotonic() + self.timeout_s,
            ))  # fmt: skip
        self._starting = [s for s in self._starting if not self._advance(s)]

    @property
    def pending(self) -> int:
        """Replacements started that have not joined or failed yet."""
        return len(self._starting)

    def close(self) -> None:
        """Kill the replacements still under way (the run is over)."""
        for s in self._starting:
            kill_actor(s.handle)
        self._starting = []

    def _advance(self, s: _Starting) -> bool:
        """Take ``s`` on by as many stages as have answered; True once it joined or failed."""
        while True:
            if not _answered(s.ref):
                if time.monotonic() < s.deadline:
                    return False
                self._fail(s, f"it did not join within {self.timeout_s:g} s" + self._lacking())
                return True
            try:
                answer = _answer(s.ref)
            except Exception as e:
                self._fail(s, repr(e)[:300])
                return True
            if s.stage == "start":
                s.kv_capacity_tokens = int(answer["kv_capacity_tokens"])
                s.ref, s.stage = s.handle.sync.remote(None), "sync"
            elif s.stage == "sync":
                s.version = int(answer["version"])
                s.ref = self.dep.coordinator.add_instance.remote(
                    s.instance_id, s.handle, kv_capacity_tokens=s.kv_capacity_tokens,
                    version=s.version,
                )  # fmt: skip
                s.stage = "join"
            else:
                self.dep.rollouts[s.instance_id] = s.handle
                self.replaced[s.lost] = s.instance_id
                log.info("instance_replaced", lost=s.lost, instance=s.instance_id,
                         version=s.version)  # fmt: skip
                return True

    def _fail(self, s: _Starting, why: str) -> None:
        kill_actor(s.handle)
        self.not_replaced.append(s.lost)
        log.error("instance_replacement_failed", lost=s.lost, instance=s.instance_id,
                  stage=s.stage, error=why)  # fmt: skip

    def _lacking(self) -> str:
        import ray

        cfg = self.dep.cfg.rollout
        need = {"CPU": cfg.cpus_per_instance, "GPU": cfg.gpus_per_instance or 0.0}
        cluster: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        lacking = missing_resources(need, 1, cluster)
        if lacking:
            return f"; the cluster lacks {'; '.join(lacking)}"
        free: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
        return f"; free now: {free}"


def _answered(ref: Any) -> bool:
    """Whether the call behind ``ref`` has answered (without waiting)."""
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _answer(ref: Any) -> Any:
    """The answer of a call that has answered (its error raised)."""
    import ray

    return ray.get(ref)
