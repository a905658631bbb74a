"""The driver side of ``staleflow train``: what starts, watches and stops the Ray deployment
(the actors themselves are in :mod:`staleflow_trainer.actors`).

* :mod:`~staleflow_trainer.runtime.wiring` — ``staleflow train``: ``train(cfg)`` over a
  deployment, and the run's summary.
* :mod:`~staleflow_trainer.runtime.deployment` — ``Deployment``: one actor per component,
  driven until the run is done, then stopped.
* :mod:`~staleflow_trainer.runtime.prepare` — what a deployment is built from before its actors
  start: Ray, placement, the model, the resume point, preflight checks, engine arguments.
* :mod:`~staleflow_trainer.runtime.startup` — before a run starts: anything left to train, a
  Ray start-up that retries.
* :mod:`~staleflow_trainer.runtime.replacements` — new rollout instances in place of lost ones.
"""
