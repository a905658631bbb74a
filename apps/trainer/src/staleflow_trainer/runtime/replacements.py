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

Whatever the limit, the driver logs each loss (``instance_lost``, with the control actor's
reason and how many of the trajectories it held went back to the queue, were finished or were
dropped), so the run's own output says when it goes on with fewer instances.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import attrs
import structlog

from staleflow_trainer.actors.liveness import kill_actor
from staleflow_trainer.errors import ComponentLost
from staleflow_trainer.runtime.prepare import placement_hint

log = structlog.get_logger(__name__)
#: (key of the control actor's loss record, field of the instance_lost line)
_HELD = (("queued", "requeued"), ("finished", "finished"), ("dropped", "dropped"))


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
    coordinator: Any = None  # the control actor the join went to
    retry_at: float | None = None  # a join refused for a version not yet published: again then
    why: str = ""  # why the last join was refused


#: How long the driver waits for the control actor to say why it lost an instance (for the log).
LOST_QUERY_S = 10.0
#: A join refused because the control actor has not yet recorded the version the replacement
#: pulled (the trainer pushed it, the core has not seen the push) is sent again this much later.
JOIN_RETRY_S = 1.0


class Replacer:
    """Logs the lost instances of ``dep`` (a ``Deployment``) and replaces them, at most
    ``limit`` in its life (0: none).

    The driver calls :meth:`update` with the instances the control actor has in the run
    (its ``drain`` answer); an instance the driver knew in the run and the answer leaves out
    was lost. So a loss is seen whichever control actor made it: one that crashed and was
    replaced (the new one starts from the instances still alive) included."""

    def __init__(self, dep: Any, limit: int, timeout_s: float) -> None:
        self.dep = dep
        self.limit = limit
        self.timeout_s = timeout_s
        self.started = 0
        self.replaced: dict[str, str] = {}  # lost id -> the instance that joined in its place
        self.not_replaced: list[str] = []  # lost beyond the limit, or their replacement failed
        self.members: set[str] = set(dep.rollouts)  # in the run, as far as the driver knows
        self.lost: dict[str, str] = {}  # every instance lost so far -> the reason given
        self._starting: list[_Starting] = []

    def update(self, in_run: Iterable[str]) -> None:
        """``in_run``: the instances the control actor has now. Start a replacement for each
        member it left out while the limit allows, then move every replacement under way on
        by what has answered (no waiting); one that joins is a member from then on. Raises
        :class:`ComponentLost` once no instance is left in the run and none is starting."""
        live = set(in_run)
        for iid in sorted(self.members - live):
            self._lost(iid)
        self.members = live
        self._starting = [s for s in self._starting if not self._advance(s)]
        if (why := self.stranded()) is not None:
            raise ComponentLost(why, component="rollout")

    @property
    def pending(self) -> int:
        """Replacements started that have not joined or failed yet."""
        return len(self._starting)

    def stranded(self) -> str | None:
        """Why the run cannot go on, when no instance is left in it and none is starting
        (every one lost, the ``rollout.replace_lost`` limit spent); None while one is."""
        if self.members or self._starting:
            return None
        lost = "; ".join(f"{iid}: {why}" for iid, why in sorted(self.lost.items()))
        return (
            f"every rollout instance is lost ({lost}) and none is starting "
            f"({self.started} of rollout.replace_lost={self.limit} replacements started, "
            f"{len(self.replaced)} joined): nothing can generate. The last checkpoint resumes "
            "the run (run.resume=auto) once the cause is fixed"
        )

    def close(self) -> None:
        """Kill the replacements still under way (the run is over)."""
        for s in self._starting:
            kill_actor(s.handle)
            log.info("instance_replacement_stopped", lost=s.lost, instance=s.instance_id,
                     stage=s.stage, reason="the run ended")  # fmt: skip
        self._starting = []

    def _lost(self, iid: str) -> None:
        rec = self._lost_record(iid)  # what it held: back in the queue, finished or dropped
        # "queued": all that went back to the queue, routes it never took included
        held = {to: len(rec[k]) for k, to in _HELD if k in rec}
        self.lost[iid] = str(rec.get("error") or "no reason recorded")
        log.warning("instance_lost", instance=iid, error=rec.get("error"), **held,
                    replace_lost=self.limit)  # fmt: skip
        if not self.limit:
            return  # nothing to replace: the control actor already let it go
        handle = self.dep.rollouts.pop(iid, None)
        if handle is not None:
            kill_actor(handle)  # a hung actor may still hold its bundle
        if self.started >= self.limit:
            self.not_replaced.append(iid)
            log.warning("instance_not_replaced", lost=iid, limit=self.limit,
                        hint="rollout.replace_lost")  # fmt: skip
            return
        self.started += 1
        new_id, new = self.dep.new_rollout(bundle_of=iid)
        log.info("instance_replacing", lost=iid, instance=new_id)
        self._starting.append(_Starting(
            lost=iid, instance_id=new_id, handle=new, ref=new.start.remote(), stage="start",
            deadline=time.monotonic() + self.timeout_s,
        ))  # fmt: skip

    def _lost_record(self, iid: str) -> dict[str, Any]:
        """The control actor's record of losing ``iid`` (its ``error`` and the ids it held:
        ``requeued``, ``finished``, ``dropped``); empty if it cannot say."""
        try:
            lost = _answer_within(self.dep.coordinator.lost_instances.remote(), LOST_QUERY_S)
            return dict(next((x for x in lost if x["instance_id"] == iid), {}))
        except Exception:  # the log line goes out without it
            return {}

    def _advance(self, s: _Starting) -> bool:
        """Take ``s`` on by as many stages as have answered; True once it joined or failed."""
        while True:
            if s.stage == "join":
                if s.retry_at is not None and time.monotonic() < s.retry_at:
                    if time.monotonic() < s.deadline:
                        return False
                    self._fail(s, f"it did not join within {self.timeout_s:g} s: {s.why}")
                    return True
                if s.retry_at is not None or s.coordinator is not self.dep.coordinator:
                    self._join(s)  # a retry is due, or the control actor was replaced
            if not _answered(s.ref):
                if time.monotonic() < s.deadline:
                    return False
                self._fail(s, f"it did not join within {self.timeout_s:g} s" + self._lacking())
                return True
            try:
                answer = _answer(s.ref)
                if s.stage == "start":
                    s.kv_capacity_tokens = int(answer["kv_capacity_tokens"])
                elif s.stage == "sync":
                    s.version = int(answer["version"])
            except Exception as e:
                if s.stage == "join" and "version must be in" in str(e):
                    s.retry_at, s.why = time.monotonic() + JOIN_RETRY_S, repr(e)[:300]
                    continue
                if s.stage == "join" and s.coordinator is not self.dep.coordinator:
                    continue  # the join went to a control actor that is gone: to the new one
                self._fail(s, repr(e)[:300])
                return True
            if s.stage == "start":
                s.ref, s.stage = s.handle.sync.remote(None), "sync"
            elif s.stage == "sync":
                self._join(s)
            else:
                self.dep.rollouts[s.instance_id] = s.handle
                self.members.add(s.instance_id)
                self.replaced[s.lost] = s.instance_id
                log.info("instance_replaced", lost=s.lost, instance=s.instance_id,
                         version=s.version)  # fmt: skip
                return True

    def _join(self, s: _Starting) -> None:
        """Hand the started replacement to the control actor of now."""
        s.coordinator = self.dep.coordinator
        s.retry_at = None
        s.ref = s.coordinator.add_instance.remote(
            s.instance_id, s.handle, kv_capacity_tokens=s.kv_capacity_tokens, version=s.version
        )
        s.stage = "join"

    def _fail(self, s: _Starting, why: str) -> None:
        kill_actor(s.handle)
        self.not_replaced.append(s.lost)
        log.error("instance_replacement_failed", lost=s.lost, instance=s.instance_id,
                  stage=s.stage, error=why)  # fmt: skip

    def _lacking(self) -> str:
        cfg = self.dep.cfg.rollout
        return placement_hint(
            {"CPU": cfg.cpus_per_instance, "GPU": cfg.gpus_per_instance or 0.0}, 1
        )


def _answered(ref: Any) -> bool:
    """Whether the call behind ``ref`` has answered (without waiting)."""
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _answer(ref: Any) -> Any:
    """The answer of a call that has answered (its error raised)."""
    import ray

    return ray.get(ref)


def _answer_within(ref: Any, timeout_s: float) -> Any:
    """The answer of the call behind ``ref``, waited for at most ``timeout_s``."""
    import ray

    return ray.get(ref, timeout=timeout_s)
