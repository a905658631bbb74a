"""A rollout instance's poll on the wire: its arguments and its answer, with the outcomes
packed by prompt (``RolloutActor.poll`` sends them, the control shell unpacks them); and an
interrupt's answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine_adapters import pack_ids, unpack_ids


def pack_outcomes(outcomes: Sequence[tuple[str, int, str | None]]) -> list[Any] | None:
    """Outcomes ``(id, response length, finish reason or None)`` as ``[ids, lengths,
    finishes]``: the ids packed (``engine_adapters.pack_ids``), the lengths and finish reasons
    in the unpacked order (``finishes`` one value when they are all the same); None for none.
    :func:`unpack_outcomes` reverses it (in that order)."""
    if not outcomes:
        return None
    ids = pack_ids(t for t, _, _ in outcomes)
    each: dict[str, list[tuple[str, int, str | None]]] = {}
    for o in outcomes:
        each.setdefault(o[0], []).append(o)
    ordered = [each[t].pop(0) for t in unpack_ids(ids)]  # by group, as the ids unpack
    finishes = [f for _, _, f in ordered]
    return [
        ids,
        [g for _, g, _ in ordered],
        finishes[0] if len(set(finishes)) == 1 else finishes,
    ]


def unpack_outcomes(packed: Sequence[Any] | None) -> list[tuple[str, int, str | None]]:
    """The outcomes of a :func:`pack_outcomes` list."""
    if not packed:
        return []
    ids, lengths, finishes = packed
    ids = unpack_ids(ids)
    if not isinstance(finishes, list):
        finishes = [finishes] * len(ids)
    if not len(ids) == len(lengths) == len(finishes):
        raise ValueError(f"packed outcomes do not line up: {len(ids)} ids, {len(lengths)} "
                         f"lengths, {len(finishes)} finish reasons")  # fmt: skip
    return [(t, int(g), f) for t, g, f in zip(ids, lengths, finishes, strict=True)]


def poll_args(request: Mapping[str, Any]) -> tuple[Any, ...]:
    """A ``SnapshotDecoder.request()`` as :meth:`RolloutActor.poll`'s arguments."""
    if request.get("full"):
        return (None, True)
    return (int(request["ack"]),) if "ack" in request else ()


def unpack_poll(p: Sequence[Any] | None) -> dict[str, Any] | None:
    """A :meth:`RolloutActor.poll` answer (``[delta, outcomes, refused, errors]``, trailing
    empty ones left out) as ``snapshot``, ``outcomes`` (``[id, length, finish]`` each),
    ``refused`` and ``errors``; None for None (nothing happened)."""
    if p is None:
        return None
    delta, outcomes, refused, errors = [*p, None, None, None, None][:4]
    return {"snapshot": delta, "outcomes": [list(o) for o in unpack_outcomes(outcomes)],
            "refused": unpack_ids(refused or ()), "errors": list(errors or ())}  # fmt: skip


def poll_parts(p: Sequence[Any]) -> dict[str, Any]:
    """The parts of a :meth:`RolloutActor.poll` answer by name (those it has): ``snapshot``
    (the delta), ``outcomes``, ``refused``, ``errors``."""
    return dict(zip(("snapshot", "outcomes", "refused", "errors"), p, strict=False))


def interrupt_outcomes(
    iid: str, ids: Sequence[str], answer: Sequence[Any]
) -> list[tuple[str, int, str | None]]:
    """The outcomes ``(id, response length, finish reason or None)`` an interrupt of ``ids`` on
    ``iid`` answered with: per id (in the order sent) its response length (unfinished),
    ``[length, finish reason]``, or None (its outcome came, or comes, with a poll: left out).
    An answer of another length is refused."""
    if len(answer) != len(ids):
        raise ValueError(f"{iid!r} answered an interrupt of {len(ids)} ids with "
                         f"{len(answer)} outcomes")  # fmt: skip
    return [
        (t, int(a), None) if isinstance(a, int) else (t, int(a[0]), str(a[1]))
        for t, a in zip(ids, answer, strict=True)
        if a is not None
    ]
