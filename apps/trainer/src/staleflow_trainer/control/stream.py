"""Streaming the next batch into the trainer (``trainer.stream_batch``): a function over the
:class:`~.core.ControlCore`, as :mod:`.instances` is.

While the trainer waits for the batch it takes next, every group that has settled in it (the
protocol's ``next_batch_groups``: only the core's own ``drop_group`` could take it out, and
the core drops a group before it settles, never after) goes to the trainer at once, in a
:class:`~.effects.TrainPart`, each group once (the core forgets them when it consumes the
batch). The :class:`~.effects.Train` that follows still names the whole batch: the trainer
finishes what it has not seen and takes the step.
What was streamed is part of the core's saved state, so a restored core sends each group once
and counts it once (``streamed_groups``). A trainer that restarted with it has lost the parts
it held: the ``Train`` names every group, and the trainer does the ones it does not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from staleflow_trainer.control import effects as fx

if TYPE_CHECKING:
    from staleflow_trainer.control.core import ControlCore


def stream_settled(core: ControlCore, out: list[fx.Effect]) -> None:
    """A ``TrainPart`` for the groups settled in the next batch since the last one."""
    proto = core.protocol
    version = proto.next_buffer
    new = [str(g) for g in proto.next_batch_groups() if str(g) not in core.streamed]
    if not new:
        return
    ids: list[tuple[str, ...]] = []
    staleness: list[tuple[int, ...]] = []
    rewards: list[tuple[float, ...]] = []
    tokens = response = 0
    for gid in new:
        members = tuple(str(t) for t in proto.group(gid).finished)
        ids.append(members)
        entries = [core.ledger.entries[t] for t in members]
        staleness.append(tuple(version - proto.trajectory(t).version for t in members))
        rewards.append(tuple(cast(float, e.reward) for e in entries))
        tokens += sum(e.tokens for e in entries)
        response += sum(e.generated for e in entries)
        core.streamed.add(gid)
    core.counters["streamed_groups"] += len(new)
    out.append(
        fx.TrainPart(
            version=version,
            group_ids=tuple(new),
            trajectory_ids=tuple(ids),
            staleness=tuple(staleness),
            rewards=tuple(rewards),
            tokens=tokens,
            response_tokens=response,
        )
    )
