"""Prompt groups: one prompt expanded into its members (``TrajectoryStore.submit_group``), and
the record of one group in a batch submitted by prompt key (``TrajectoryStore.submit_groups``).

A batch sends the sampling parameters once for all its groups; each group names its prompt by
its key in the prompt table (``TrajectoryStore.prompts``) and may carry its own seed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from engine_adapters import SamplingParams
from trajectory_server._prompts import PromptTable, check_prompt_key
from trajectory_server._records import (
    MAX_GROUP_SIZE,
    Trajectory,
    check_id,
    is_int,
    sampling_params,
)
from trajectory_server.errors import InvalidRecord

#: Most trajectories one ``submit_groups`` request may create
MAX_BATCH_MEMBERS = 1 << 20
#: A group's seed: member ``i`` gets ``seed + i``, which must stay a signed 64-bit int
SEED_RANGE = (-(2**63), 2**63 - 1 - MAX_GROUP_SIZE)


def check_group_size(n: object, target_lengths: Sequence[int] | None = None) -> None:
    """``n`` members (1 to ``MAX_GROUP_SIZE``), and as many target lengths if any."""
    if not is_int(n) or not 1 <= n <= MAX_GROUP_SIZE:  # type: ignore[operator]
        raise InvalidRecord(
            f"n must be an int in [1, {MAX_GROUP_SIZE}] (members of one group), got {n!r:.40}",
            field="n",
            value=n,
        )
    if target_lengths is not None and len(target_lengths) != n:
        raise InvalidRecord(
            f"target_lengths must have n={n} entries, got {len(target_lengths)}",
            field="target_lengths",
        )


@attrs.frozen(kw_only=True)
class GroupByKey:
    """One group of a batched submission: ``n`` members ``group_id/i`` of the prompt put under
    ``prompt_key``, sampled with the batch's parameters and, when ``seed`` is not None, that
    seed instead of the batch's (member ``i`` gets ``seed + i``)."""

    group_id: str
    n: int
    prompt_key: int
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        check_id("group_id", self.group_id)
        check_group_size(self.n)
        check_prompt_key(self.prompt_key)
        lo, hi = SEED_RANGE
        if self.seed is not None and (not is_int(self.seed) or not lo <= self.seed <= hi):
            raise InvalidRecord(
                f"seed must be None or an int in [-2**63, 2**63 - 1 - {MAX_GROUP_SIZE}] (member "
                f"i gets seed + i), got {self.seed!r:.40}",
                field="seed",
            )

    def sampling(self, shared: SamplingParams) -> SamplingParams:
        """The batch's parameters with this group's seed, if it has one."""
        return shared if self.seed is None else sampling_params(shared, seed=self.seed)


def check_batch(
    groups: Sequence[GroupByKey], sampling: SamplingParams | None
) -> tuple[list[GroupByKey], SamplingParams]:
    """A ``submit_groups`` batch checked: its groups (``GroupByKey`` records, at most
    ``MAX_BATCH_MEMBERS`` members in all) and its sampling parameters (default ones if None)."""
    if sampling is None:
        sampling = SamplingParams()
    elif not isinstance(sampling, SamplingParams):
        raise InvalidRecord(
            f"sampling must be an engine_adapters.SamplingParams, got {type(sampling).__name__}",
            field="sampling",
        )
    if isinstance(groups, str | bytes) or not isinstance(groups, Iterable):
        raise InvalidRecord(
            f"groups must be a sequence of GroupByKey, got {type(groups).__name__}",
            field="groups",
        )
    out = list(groups)
    for i, g in enumerate(out):
        if not isinstance(g, GroupByKey):
            raise InvalidRecord(
                f"groups[{i}] must be a GroupByKey, got {type(g).__name__}", field="groups"
            )
    total = sum(g.n for g in out)
    if total > MAX_BATCH_MEMBERS:
        raise InvalidRecord(
            f"a batch may create at most {MAX_BATCH_MEMBERS} trajectories, got {total}",
            field="groups",
        )
    return out, sampling


def prompt_of(
    prompts: PromptTable,
    prompt_token_ids: Iterable[int] | None,
    prompt_key: int | None,
    metadata: Mapping[str, Any] | None,
) -> tuple[Iterable[int], Mapping[str, Any] | None]:
    """A group's prompt tokens and metadata: given, or (``prompt_token_ids`` None) those put
    under ``prompt_key`` in ``prompts``, with ``metadata``'s entries over the ones put."""
    if (prompt_key is None) == (prompt_token_ids is None):
        both = "both" if prompt_key is not None else "neither"
        raise InvalidRecord(f"give prompt_token_ids or prompt_key, got {both}", field="prompt_key")
    if prompt_token_ids is not None:
        return prompt_token_ids, metadata
    tokens, put = prompts.get(prompt_key)
    return tokens, {**put, **(metadata or {})}


def expand(
    group_id: str,
    prompt_token_ids: Iterable[int],
    n: int,
    sampling: SamplingParams,
    metadata: Mapping[str, Any] | None,
    target_lengths: Sequence[int] | None,
) -> list[Trajectory]:
    """The ``n`` members ``{group_id}/{i}`` of one prompt; with a sampling ``seed``, member
    ``i`` gets ``seed + i`` so members differ. The caller has checked ``group_id``, ``n`` and
    ``target_lengths`` (``check_id``, :func:`check_group_size`, or a :class:`GroupByKey`)."""
    first = Trajectory(
        trajectory_id=f"{group_id}/0",
        group_id=group_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        metadata=metadata,
        target_length=None if target_lengths is None else target_lengths[0],
    )
    members = [first]
    for i in range(1, n):
        seed = sampling.seed
        s = sampling if seed is None else sampling_params(sampling, seed=seed + i)
        target = None if target_lengths is None else target_lengths[i]
        members.append(
            attrs.evolve(first, trajectory_id=f"{group_id}/{i}", sampling=s, target_length=target)
        )
    return members
