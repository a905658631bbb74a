"""A reward worker: reads finished trajectories from the trajectory server by id, decodes the
responses and scores them with the configured plug-in.

``decoder``: the tokenizer's backend as the driver checked it (``reward.decode``); the worker
then decodes without importing ``transformers``. None: it loads the tokenizer at
``tokenizer_path``.

Failures (an exception, a non-score, a timeout) are retried by :class:`RewardRunner`; a
trajectory that still fails comes back with no score and the reason, and the control core
drops its group through the protocol. A trajectory the store no longer holds as finished
(dropped meanwhile) comes back with no score either; the core ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from engine_adapters import unpack_ids
from staleflow_trainer.actors.log_relay import KeepsWarnings
from staleflow_trainer.actors.ts_link import StoreLink
from staleflow_trainer.actors.work_wire import pack_scores
from staleflow_trainer.reward import RewardRunner
from staleflow_trainer.reward.decode import ResponseDecoder

log = structlog.get_logger(__name__)


class RewardActor(KeepsWarnings):
    """Wrap with ``ray.remote``. ``score`` takes ids (packed, ``engine_adapters.pack_ids``)
    and answers a score or None and a reason for each (``work_wire.pack_scores``)."""

    def __init__(
        self,
        *,
        fn: str,
        retries: int,
        timeout_s: float,
        tokenizer_path: str,
        ts_address: Sequence[Any],
        ts_token: str | None,
        decoder: str | None = None,
    ) -> None:
        self._keep_warnings()
        self._runner = RewardRunner(fn, retries=retries, timeout_s=timeout_s)
        self._decoder = ResponseDecoder(backend=decoder, tokenizer_path=tokenizer_path)
        log.info("reward_worker_started",
                 decodes_with="tokenizers" if self._decoder.portable else "transformers")  # fmt: skip
        self._ts = StoreLink(ts_address, ts_token)

    def _read(self, ids: list[str]) -> dict[str, Any]:
        from trajectory_server.errors import StateError

        async def read(ts: Any) -> dict[str, Any]:
            try:
                got = list(await ts.finished(ids))
            except StateError:  # some were dropped meanwhile: one by one
                got = []
                for tid in ids:
                    try:
                        got.extend(await ts.finished([tid]))
                    except StateError:
                        continue
            return {ft.trajectory.trajectory_id: ft.trajectory for ft in got}

        return self._ts.run(read)

    def score(self, trajectory_ids: Sequence[Any]) -> list[Any]:
        """Score these trajectories (the ids may come packed): ``[scores, reasons]`` in the
        order the ids unpack (``work_wire.pack_scores``)."""
        ids = unpack_ids(trajectory_ids)
        payloads = self._read(ids)
        out: list[tuple[float | None, str | None]] = []
        for tid in ids:
            t = payloads.get(tid)
            if t is None:
                out.append((None, "not a finished trajectory in the store"))
                continue
            md = dict(t.metadata)
            text = self._decoder.decode(t.generated_token_ids)
            o = self._runner.score(
                trajectory_id=tid,
                data_source=str(md.get("data_source", "unknown")),
                solution_str=text,
                ground_truth=str(md.get("ground_truth", "")),
                extra_info=dict(md.get("extra_info") or {}),
            )
            out.append((o.score, o.reason))
        return pack_scores(out)
