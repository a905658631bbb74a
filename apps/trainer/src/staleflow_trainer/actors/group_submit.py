"""What the control shell sends the trajectory server for new prompt groups: one request per
batch of groups (``TrajectoryClient.submit_groups``), the sampling parameters once, and per
group its id, member count, the prompt's row (the key of the server's prompt table, which the
driver filled at start-up: ``TrajectoryServerActor.load_prompts``) and the seed the group always
gets. No prompt tokens or metadata travel with it, nor a sim engine's response lengths: the
instance draws those from the trajectory ids (``sim.workload.GroupLengths.of``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from engine_adapters import SamplingParams
from staleflow_trainer.config import AppConfig
from staleflow_trainer.control import effects as fx
from staleflow_trainer.data.tokenize import PromptLengths
from trajectory_server import GroupByKey

log = structlog.get_logger(__name__)


class GroupSubmitter:
    def __init__(self, cfg: AppConfig, prompts: PromptLengths) -> None:
        self.cfg = cfg
        self.prompts = prompts

    def sampling(self) -> SamplingParams:
        """The run's sampling parameters (every group's seed is its own: :meth:`seed`)."""
        s = self.cfg.rollout.sampling
        eos = self.prompts.eos_token_id
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=() if eos is None else (eos,),
        )

    def seed(self, group_id: str) -> int:
        """The seed group ``group_id`` (``g<serial>``) always gets (member ``i``: + ``i``)."""
        serial = int(group_id[1:]) + 1
        return (self.cfg.run.seed * 1_000_003 + serial * 64) % (2**31)

    async def submit(self, ts: Any, groups: Sequence[fx.GroupSpec]) -> None:
        """Submit ``groups`` to the trajectory server ``ts`` in one request, all or none; a
        group already there (resubmitted after a crash) is left as it is."""
        if not groups:
            return
        batch = [GroupByKey(group_id=g.group_id, n=g.members, prompt_key=g.row,
                            seed=self.seed(g.group_id)) for g in groups]  # fmt: skip
        added = await ts.submit_groups(batch, sampling=self.sampling(), skip_existing=True)
        if added != sum(g.members for g in groups):
            log.debug("submit_groups_skipped", groups=len(groups), added=added)
