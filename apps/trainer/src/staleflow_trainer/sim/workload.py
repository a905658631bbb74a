"""The simulated prompt stream: group ``g`` is the same in every run with the same seed.

Groups are drawn in chunks of :data:`CHUNK`; chunk ``c`` uses sub-stream ``c`` of the response
length sampler (``sim.workload``: a capped distribution or a trace of groups, with the
group correlation kept; ``engine_adapters.workload``) and its own
generator for prompt lengths and reward rates. A policy that consumes more groups (aborts,
filtering, redundancy) just reads further down the same stream, so every policy sees the same
workload in the same order.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import numpy as np

from engine_adapters.workload import LengthSampler
from staleflow_trainer.sim.spec import SimSpec

CHUNK = 64
#: chunks of lengths a GroupLengths keeps drawn (the oldest goes first)
KEEP_CHUNKS = 16
#: a trajectory id the control core mints, ``g<group index>/<member>`` (``g000064/3``)
_SIM_ID = re.compile(r"g(\d+)/(\d+)", re.ASCII)


@attrs.frozen(kw_only=True, slots=True)
class GroupDraw:
    index: int
    prompt_len: int
    response_lens: tuple[int, ...]  # one true (uncapped-by-engine) length per member
    reward_rate: float  # P(reward = 1) of each member
    rewards: tuple[float, ...]  # Bernoulli(reward_rate) draws, one per member


class GroupLengths:
    """The response lengths of the stream's groups alone (what a sim engine under ``staleflow
    train`` stops at): chunk ``c`` is sub-stream ``c`` of the sampler, ``members`` a group."""

    def __init__(self, lengths: Any, members: int) -> None:
        self._sampler = LengthSampler(lengths)
        self._members = members
        self._chunks: dict[int, Any] = {}

    def chunk(self, c: int) -> Any:
        """Chunk ``c``'s lengths, one row per group (``CHUNK`` x ``members``)."""
        got = self._chunks.get(c)
        if got is None:
            if len(self._chunks) >= KEEP_CHUNKS:  # drawn again if asked for again: the same
                del self._chunks[next(iter(self._chunks))]
            got = self._chunks[c] = self._sampler.groups(CHUNK, self._members, stream=c)
        return got

    def targets(self, index: int, members: int, cap: int) -> list[int]:
        """Group ``index``'s first ``members`` lengths, each in ``[1, cap]``."""
        c, i = divmod(index, CHUNK)
        row = self.chunk(c)[i]
        return [max(1, min(int(row[m % len(row)]), cap)) for m in range(members)]

    def of(self, trajectory_id: str, cap: int) -> int | None:
        """The length of trajectory ``g<index>/<member>`` (member ``member`` of group
        ``index``; what :meth:`targets` gives it), in ``[1, cap]``; None for an id of another
        shape. A rollout instance with a sim engine finds its trajectories' lengths here, from
        their ids: no length travels with the work."""
        got = _SIM_ID.fullmatch(trajectory_id)
        if got is None:
            return None
        index, member = int(got[1]), int(got[2])
        return self.targets(index, member + 1, cap)[member]


def engine_lengths(cfg: Any) -> GroupLengths:
    """The lengths of an app config's groups (``staleflow train`` with sim engines: the same as
    ``staleflow simulate`` draws for them)."""
    from staleflow_trainer.config_sim import length_workload

    p = cfg.protocol
    return GroupLengths(length_workload(cfg), p.group_size + p.group_redundancy)


class PromptStream:
    """Deterministic, unbounded sequence of groups for one spec (seed, lengths, group size)."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self.lengths = GroupLengths(spec.lengths, spec.group_size + spec.group_redundancy)
        self._chunks: dict[int, list[GroupDraw]] = {}

    def group(self, index: int) -> GroupDraw:
        c, i = divmod(index, CHUNK)
        chunk = self._chunks.get(c)
        if chunk is None:
            chunk = self._chunks[c] = self._draw(c)
        return chunk[i]

    def _draw(self, c: int) -> list[GroupDraw]:
        s = self.spec
        members = s.group_size + s.group_redundancy  # n' for every policy: same first n
        lens = self.lengths.chunk(c)
        rng = np.random.default_rng([s.seed, 7919, c])
        prompts = np.clip(
            np.rint(s.prompt_len * np.exp(s.prompt_len_sigma * rng.standard_normal(CHUNK))),
            1,
            s.prompt_len_max,
        ).astype(np.int64)
        # Per-group reward rate: Beta with the configured mean (concentration 2), so some groups
        # are all-0 / all-1 (what dynamic sampling filters), most are mixed.
        m = min(max(s.reward_mean, 1e-3), 1 - 1e-3)
        rates = rng.beta(2 * m, 2 * (1 - m), CHUNK)
        draws = rng.random((CHUNK, members)) < rates[:, None]
        return [
            GroupDraw(
                index=c * CHUNK + k,
                prompt_len=int(prompts[k]),
                response_lens=tuple(int(x) for x in lens[k]),
                reward_rate=float(rates[k]),
                rewards=tuple(1.0 if d else 0.0 for d in draws[k]),
            )
            for k in range(CHUNK)
        ]

    def reward(self, group_index: int, member: int) -> float:
        """Synthetic reward of one member (deterministic per group and member)."""
        return self.group(group_index).rewards[member]
