"""What the control shell sends the reward workers and the trainer, and what comes back, on the
wire: trajectory ids packed by prompt (``engine_adapters.pack_ids``: a group's prefix once,
then its member numbers), and answers in the order of the ids sent, so no id comes back.

* a score call sends the packed ids (``RewardActor.score``) and is answered ``[scores,
  reasons]``: one score (or None) per id, in the unpacked order, and the reason of each id
  with no score under its index (:func:`pack_scores`, :func:`score_rows`);
* scores and rewards travel as ints where they are integral (:func:`compact`), floats
  again on arrival;
* a training step sends each consumed group's members packed (:func:`train_batch`), beside
  their staleness and rewards in the unpacked order (:func:`batch_members`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from engine_adapters import pack_ids, unpack_ids

#: the reason of a trajectory with no score whose reward worker gave none
NO_REASON = "no reason given"


def compact(x: float) -> float | int:
    """A score or reward as it travels: an integral value (most rewards are 0 or 1) as an int,
    which pickles in 2 to 5 bytes instead of a float's 9; ``float()`` of it is the value again
    (-0.0 and values of 2^31 and more stay floats)."""
    x = float(x)
    negative_zero = x == 0 and math.copysign(1.0, x) < 0
    if x.is_integer() and abs(x) < 2**31 and not negative_zero:
        return int(x)
    return x


def pack_scores(scores: Sequence[tuple[float | None, str | None]]) -> list[Any]:
    """``(score or None, reason)`` per id, in the order of the ids received, as ``[scores,
    reasons]`` (``reasons``: index -> reason, for the ids with no score)."""
    missing = {
        i: NO_REASON if r is None else str(r) for i, (s, r) in enumerate(scores) if s is None
    }
    return [[None if s is None else compact(s) for s, _ in scores], missing]


def score_rows(packed_ids: Sequence[Any], answer: Sequence[Any]) -> list[list[Any]]:
    """``[id, score | None, reason | None]`` per id of a score call that sent ``packed_ids``
    and got ``answer`` (:func:`pack_scores`). An answer that does not line up is refused."""
    ids = unpack_ids(packed_ids)
    scores, reasons = answer
    if len(scores) != len(ids):
        raise ValueError(f"a reward worker answered {len(scores)} scores for {len(ids)} ids")
    return [
        [t, None, str(reasons.get(i, NO_REASON))] if s is None else [t, float(s), None]
        for i, (t, s) in enumerate(zip(ids, scores, strict=True))
    ]


def train_batch(
    version: int,
    group_ids: Sequence[str],
    members: Sequence[Sequence[str]],
    staleness: Sequence[Sequence[int]],
    rewards: Sequence[Sequence[float]],
) -> dict[str, Any]:
    """A consumed batch for ``TrainerActor.train_batch``: per group its id, its members packed,
    and their staleness and rewards in the order the members unpack."""
    packed, stale, scored = [], [], []
    for ids, s, r in zip(members, staleness, rewards, strict=True):
        p = pack_ids(ids)
        at = {t: i for i, t in enumerate(ids)}
        if len(at) != len(ids):
            raise ValueError(f"a consumed group repeats a member: {list(ids)}")
        order = [at[t] for t in unpack_ids(p)]
        packed.append(p)
        stale.append([int(s[i]) for i in order])
        scored.append([compact(r[i]) for i in order])
    return {"version": int(version), "group_ids": list(group_ids), "members": packed,
            "staleness": stale, "rewards": scored}  # fmt: skip


def batch_members(batch: Mapping[str, Any]) -> list[list[str]]:
    """The members of each group of a :func:`train_batch`, in the order of its staleness and
    rewards."""
    return [unpack_ids(p) for p in batch["members"]]
