"""The trajectory server as the run's actor: the library's ``TrajectoryServerActor`` whose
warnings and errors (a peer that failed its handshake, a frame too large, a connection limit
reached) reach the run's output like the other actors' (``log_relay``), and whose prompt
table holds the run's prompts (:meth:`TrajectoryServerActor.load_prompts`)."""

from __future__ import annotations

from typing import Any

from staleflow_trainer.actors.log_relay import KeepsWarnings
from staleflow_trainer.data.tokenize import EncodedPrompts
from trajectory_server.actor import TrajectoryServerActor as _Library


class TrajectoryServerActor(_Library, KeepsWarnings):
    """Wrap with ``ray.remote``; takes the library actor's arguments."""

    def __init__(self, **kwargs: Any) -> None:
        self._keep_warnings()
        super().__init__(**kwargs)

    async def load_prompts(self, prompts: EncodedPrompts) -> int:
        """Put every prompt row into the store's prompt table (key: the row), as the driver
        encoded them; the control process then submits groups by row. Returns the rows put."""
        return self.store.prompts.put(prompts.table())
