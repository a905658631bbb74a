"""The Ray shell of ``staleflow train``: one class per component, Ray-free until wrapped.

Each module holds a plain class that :mod:`staleflow_trainer.runtime.wiring` wraps with
``ray.remote``. The control process sees ids, versions, token counts and finish reasons only:
rollout instances take their work from the trajectory server by id and write their output to
it, reward workers and the trainer read it there by id, and weights travel through the
parameter server over NIXL, never through Ray.

* :mod:`~staleflow_trainer.actors.control` — ``ControlActor``: the control core
  (:mod:`staleflow_trainer.control`) behind a write-ahead journal of the events it is fed;
  polls instances, feeds events, carries out effects (with :mod:`.shell_io` and
  :mod:`.effect_calls`); recovers by replaying the journal and reconciling the other processes
  with the core (:mod:`.reconcile`); its fault hooks (crash at a named point, hold between
  steps) are in :mod:`.fault_hooks`, what it answers when asked (records to drain, summaries,
  read-only views) in :mod:`.control_queries`; :mod:`.liveness` tells a dead peer from a
  failing one and paces retries.
* :mod:`~staleflow_trainer.actors.rollout` — ``RolloutActor``: one engine adapter (vllm | sglang |
  sim); submit by id / poll / interrupt / sync (pull from the PS, load in place) / probe; its
  requests to the trajectory server, which survive a broken connection, in
  :mod:`.instance_store`; its poll's wire format in :mod:`.rollout_wire`; the kept
  trajectory-server connections in :mod:`.ts_link`; its weight loads in :mod:`.weight_sync`;
  its end when its engine dies in :mod:`.engine_health`.
* :mod:`~staleflow_trainer.actors.param_host` — ``ParamServerHost``: owns the ``ParamServer`` and
  its NIXL storage worker processes.
* :mod:`~staleflow_trainer.actors.trainer_actor` — ``TrainerActor``: the PyTorch trainer; reads a
  consumed batch from the trajectory server, trains, pushes every new version to the PS.
* :mod:`~staleflow_trainer.actors.reward_actor` — ``RewardActor``: reads finished trajectories
  from the trajectory server and runs the reward plug-in on them.
"""
