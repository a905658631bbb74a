"""The control shell's background work: the calls to the reward workers and the trainer, which
run beside the control loop (:meth:`BackgroundCalls.spawn`), and the first error one of them
ends with (:attr:`BackgroundCalls.fatal`), which stops the run."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from engine_adapters import pack_ids
from staleflow_trainer.actors.io_bytes import ByteCounts, size
from staleflow_trainer.actors.liveness import is_actor_death
from staleflow_trainer.actors.work_wire import score_rows, train_batch
from staleflow_trainer.config import AppConfig
from staleflow_trainer.control import effects as fx

log = structlog.get_logger(__name__)


class BackgroundCalls:
    """Mixed into ``ShellIO``, which sets these attributes."""

    cfg: AppConfig
    trainer: Any
    rewards: list[Any]
    reward_spec: dict[str, Any]
    fatal: BaseException | None
    _tasks: set[asyncio.Task[Any]]
    _counts: ByteCounts

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.fatal is None:
            self.fatal = task.exception()

    async def wait_background(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def score(self, ids: list[str]) -> list[list[list[Any]]]:
        """Score ``ids`` on the reward workers (shards in parallel); a dead worker is
        replaced and its shard scored again once."""
        k = len(self.rewards)
        shards = [ids[i::k] for i in range(k)]
        return list(await asyncio.gather(*(self._score_shard(i, s) for i, s in enumerate(shards)
                                           if s)))  # fmt: skip

    async def _score_shard(self, i: int, shard: list[str]) -> list[list[Any]]:
        packed = pack_ids(shard)
        for attempt in (0, 1):
            self._counts.count("rewards", size(packed), "score")
            worker = self.rewards[i]
            try:
                answer = await worker.score.remote(packed)
                self._counts.count("rewards", size(answer), "score_answer")
                return score_rows(packed, answer)
            except Exception as err:
                if not is_actor_death(err) or attempt or not self.reward_spec:
                    return [[t, None, f"reward worker failed: {err!r}"[:200]] for t in shard]
                if self.rewards[i] is not worker:
                    continue  # a concurrent call replaced it already: score on that one
                log.warning("reward_worker_replaced", worker=i, error=repr(err)[:200])
                self.rewards[i] = self._new_reward_worker()
        return []  # pragma: no cover - the loop returns

    def _new_reward_worker(self) -> Any:
        """A reward worker built from the spec the run's first ones were given."""
        import ray

        from staleflow_trainer.actors.reward_actor import RewardActor
        from staleflow_trainer.runtime.prepare import role_options

        options = role_options(self.cfg, "reward", num_cpus=0)
        return ray.remote(RewardActor).options(**options).remote(**self.reward_spec)

    async def train_part(self, e: fx.TrainPart) -> None:
        """Stream groups into the trainer early; a failure only logs (that step's ``Train``
        trains what did not stream in, and a dead trainer fails it)."""
        part = train_batch(e.version, e.group_ids, e.trajectory_ids, e.staleness, e.rewards)
        self._counts.count("trainer", size(part), "train_part")
        try:
            answer = await self.trainer.stream_batch_part.remote(part)
        except Exception as err:
            log.warning("train_part_failed", version=e.version, error=repr(err)[:300])
            return
        self._counts.count("trainer", size(answer), "train_part_answer")

    async def train(self, e: fx.Train) -> dict[str, Any]:
        batch = train_batch(e.version, e.group_ids, e.trajectory_ids, e.staleness, e.rewards)
        self._counts.count("trainer", size(batch), "train")
        metrics = dict(await self.trainer.train_batch.remote(batch))
        self._counts.count("trainer", size(metrics), "train_answer")
        return metrics
