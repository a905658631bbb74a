"""Prompt groups: one prompt expanded into its members (``TrajectoryStore.submit_group``), and
the record of one group in a batch submitted by prompt key (``TrajectoryStore.submit_groups``).

A batch sends the sampling parameters once for all its groups; each group names its prompt by
its key in the prompt table (``TrajectoryStore.prompts``) and may carry its own seed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from trajectory_server._prompts import PromptTable
from trajectory_server._records import (
    MAX_GROUP_SIZE,
    SamplingParams,
    Trajectory,
    check_id,
    is_int,
)
from trajectory_server.errors import InvalidRecord


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
        if not is_int(self.prompt_key):
            raise InvalidRecord(
                f"prompt_key must be an int, got {type(self.prompt_key).__name__}",
                field="prompt_key",
            )
        if self.seed is not None:
            SamplingParams(seed=self.seed)  # the seed's own check, naming the field

    def sampling(self, shared: SamplingParams) -> SamplingParams:
        """The batch's parameters with this group's seed, if it has one."""
        return shared if self.seed is None else attrs.evolve(shared, seed=self.seed)


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
    ``i`` gets ``seed + i`` so members differ."""
    check_id("group_id", group_id)
    check_group_size(n, target_lengths)
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
        s = sampling if seed is None else attrs.evolve(sampling, seed=seed + i)
        target = None if target_lengths is None else target_lengths[i]
        members.append(
            attrs.evolve(first, trajectory_id=f"{group_id}/{i}", sampling=s, target_length=target)
        )
    return members
