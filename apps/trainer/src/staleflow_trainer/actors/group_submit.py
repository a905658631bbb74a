"""What the control shell sends the trajectory server for a new prompt group: the prompt's row
(the key of the server's prompt table, which the driver filled at start-up:
``TrajectoryServerActor.load_prompts``), the member count and the sampling parameters (with
the seed the group always gets). No prompt tokens or metadata travel with it, nor a sim
engine's response lengths: the instance draws those from the trajectory ids
(``sim.workload.GroupLengths.of``)."""

from __future__ import annotations

from typing import Any

import structlog

from staleflow_trainer.config import AppConfig
from staleflow_trainer.control import effects as fx
from staleflow_trainer.data.tokenize import PromptLengths
from trajectory_server import SamplingParams
from trajectory_server.errors import DuplicateTrajectory

log = structlog.get_logger(__name__)


class GroupSubmitter:
    def __init__(self, cfg: AppConfig, prompts: PromptLengths) -> None:
        self.cfg = cfg
        self.prompts = prompts

    async def submit(self, ts: Any, g: fx.GroupSpec) -> None:
        """Submit group ``g`` to the trajectory server ``ts`` (already there, after a crash:
        nothing to do)."""
        s = self.cfg.rollout.sampling
        serial = int(g.group_id[1:]) + 1  # the seed a group always had
        eos = self.prompts.eos_token_id
        try:
            await ts.submit_group(
                g.group_id,
                None,
                g.members,
                prompt_key=g.row,
                echo=False,  # the ids are group_id/i: a count comes back
                sampling=SamplingParams(
                    temperature=s.temperature,
                    top_p=s.top_p,
                    max_new_tokens=s.max_new_tokens,
                    stop_token_ids=() if eos is None else (eos,),
                    seed=(self.cfg.run.seed * 1_000_003 + serial * 64) % (2**31),
                ),
            )
        except DuplicateTrajectory as err:  # already there (resubmitted after a crash)
            log.debug("submit_group_noop", group_id=g.group_id, error=str(err)[:200])
