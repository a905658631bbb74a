"""Load-balancing plan: which holder serves each (receiver, slice) a pull needs.

Theory of operation (docs/design.md, "Parameter server"). Every slice of a version lives on one or more holders
(storage workers). A receiver (a rollout instance) needs some slices. The plan assigns each
(receiver, slice) to one holder:

1. Only holders with the *best link class* to that receiver are candidates (link classes are
   ranked: e.g. same host over shared memory < same rack RDMA < cross-rack TCP).
2. Among those, pick the holder whose accumulated estimated time *after* taking this transfer
   is least; the estimated time of a transfer is ``bytes / bandwidth + latency`` of its link.
   Ties go to the less loaded holder, then to the smaller name (deterministic plans).
3. Requests are placed largest first (LPT order), which keeps the greedy close to the optimum
   makespan (``max`` accumulated time over holders); the tests compare it against a
   brute-force optimum on small instances.

``initial_load`` lets the service account for transfers already in flight on each holder, so
concurrent pulls from many receivers spread across holders. Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from .errors import UsageError


def str_tuple(values: Iterable[object]) -> tuple[str, ...]:
    """attrs converter: any iterable of names -> a tuple of str."""
    return tuple(str(v) for v in values)


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise UsageError(f"{attribute.name} must be > 0, got {value!r}", field=attribute.name)


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise UsageError(f"{attribute.name} must be >= 0, got {value!r}", field=attribute.name)


@attrs.frozen(kw_only=True)
class LinkClass:
    """A kind of link between a holder and a receiver. Lower ``rank`` is better."""

    name: str
    rank: int
    bandwidth_bytes_per_s: float = attrs.field(validator=_positive)
    latency_s: float = attrs.field(validator=_non_negative)

    def estimate_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bytes_per_s + self.latency_s


#: The link every holder has to every receiver on one machine (NIXL UCX over shared memory).
LOCAL_SHM = LinkClass(name="local-shm", rank=0, bandwidth_bytes_per_s=2.5e9, latency_s=50e-6)


@attrs.frozen(kw_only=True)
class SliceRef:
    name: str
    index: int
    nbytes: int = attrs.field(validator=_non_negative)


@attrs.frozen(kw_only=True)
class PlanRequest:
    receiver: str
    slice: SliceRef
    holders: tuple[str, ...] = attrs.field(converter=str_tuple)

    @holders.validator
    def _check_holders(
        self, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
    ) -> None:
        if not value:
            raise UsageError(
                f"slice {self.slice.name!r}[{self.slice.index}] has no holder", field="holders"
            )


@attrs.frozen(kw_only=True)
class Assignment:
    receiver: str
    slice: SliceRef
    holder: str
    link: LinkClass
    estimate_s: float


@attrs.frozen(kw_only=True)
class TransferPlan:
    assignments: tuple[Assignment, ...]
    #: accumulated estimated seconds per holder, including ``initial_load``
    load_s: Mapping[str, float]

    @property
    def makespan_s(self) -> float:
        return max(self.load_s.values(), default=0.0)

    def by_holder(self) -> dict[str, list[Assignment]]:
        out: dict[str, list[Assignment]] = {}
        for a in self.assignments:
            out.setdefault(a.holder, []).append(a)
        return out


LinkFn = Callable[[str, str], LinkClass]
"""``link(holder, receiver) -> LinkClass``."""


def uniform_link(link: LinkClass = LOCAL_SHM) -> LinkFn:
    """Every holder reaches every receiver over the same class of link."""
    return lambda _holder, _receiver: link


def plan_transfers(
    requests: Iterable[PlanRequest],
    link: LinkFn,
    initial_load: Mapping[str, float] | None = None,
) -> TransferPlan:
    """Greedy best-link, least-accumulated-time plan (see the module docstring)."""
    load: dict[str, float] = dict(initial_load or {})
    for holder, seconds in load.items():
        if seconds < 0:
            raise UsageError(
                f"initial_load[{holder!r}] must be >= 0, got {seconds!r}", field="initial_load"
            )
    reqs = list(requests)
    # Largest first; ties in a stable, deterministic order.
    order = sorted(
        range(len(reqs)),
        key=lambda i: (
            -reqs[i].slice.nbytes,
            reqs[i].receiver,
            reqs[i].slice.name,
            reqs[i].slice.index,
        ),
    )
    placed: list[Assignment | None] = [None] * len(reqs)
    for i in order:
        req = reqs[i]
        links = {h: link(h, req.receiver) for h in req.holders}
        best_rank = min(lk.rank for lk in links.values())
        best: tuple[float, float, str] | None = None
        for h, lk in links.items():
            if lk.rank != best_rank:
                continue
            done = load.get(h, 0.0) + lk.estimate_s(req.slice.nbytes)
            key = (done, load.get(h, 0.0), h)
            if best is None or key < best:
                best = key
        assert best is not None
        holder = best[2]
        lk = links[holder]
        est = lk.estimate_s(req.slice.nbytes)
        load[holder] = load.get(holder, 0.0) + est
        placed[i] = Assignment(
            receiver=req.receiver, slice=req.slice, holder=holder, link=lk, estimate_s=est
        )
    for req in reqs:
        for h in req.holders:
            load.setdefault(h, 0.0)
    return TransferPlan(assignments=tuple(a for a in placed if a is not None), load_s=load)
