"""The shared host (``sim.host_cores``): the trainer's step on cores the instances use too.

While the trainer computes, its threads and those of the instances with work share the cores
evenly (:meth:`SimSpec.host_shares`): the instances run at a pace below 1 and the trainer's
compute advances at ``1 / factor`` of its speed alone. Who has work changes during a step
(work is routed, a batch finishes), so the shares are taken again at every change, and the
compute done so far is counted at the factor it ran at. Pure bookkeeping: the shell sets the
instances' pace and schedules the end this returns.
"""

from __future__ import annotations

from staleflow_trainer.sim.spec import SimSpec


class SharedHost:
    """The trainer's compute in progress on a shared host: the seconds of it left (at its speed
    alone), the factor it runs at since ``at``, and the instances' pace meanwhile."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        #: the pace the instances run at now (1 while the trainer does not compute)
        self.pace = 1.0
        #: changes with every end :meth:`shares` schedules; an older end is stale
        self.token = 0
        self._left: float | None = None
        self._at = 0.0
        self._factor = 1.0

    @property
    def training(self) -> bool:
        return self._left is not None

    def start(self, now: float, compute_s: float) -> None:
        """The trainer starts ``compute_s`` seconds (alone) of compute at ``now``; the shares
        follow from the next :meth:`shares`."""
        self._left, self._at, self._factor = compute_s, now, 0.0

    def shares(self, now: float, busy_instances: int) -> float | None:
        """The shares for ``busy_instances`` instances with work from ``now`` on: sets
        :attr:`pace`; returns when the compute left ends at the new factor (a new
        :attr:`token`), or None when nothing changed (or the trainer does not compute)."""
        left = self._left
        if left is None:
            return None
        pace, factor = self.spec.host_shares(busy_instances)
        if self._factor:  # the compute done since the last change, at the factor it ran at
            left = self._left = max(left - (now - self._at) / self._factor, 0.0)
        self._at = now
        if factor == self._factor and pace == self.pace:
            return None
        self._factor, self.pace = factor, pace
        self.token += 1
        return now + left * factor

    def finish(self) -> None:
        """The trainer's compute ended: the instances have the host again."""
        self._left, self.pace = None, 1.0
        self.token += 1
