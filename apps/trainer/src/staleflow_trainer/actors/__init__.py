"""The Ray actors of ``staleflow train``: one class per component, Ray-free until wrapped.

Each module holds a plain class that :mod:`staleflow_trainer.wiring` wraps with
``ray.remote``. Only plain JSON-able values (dicts, lists, str, numbers) and bytes cross actor
boundaries (:mod:`staleflow_trainer.actors.payloads`); weights travel through the parameter
server over NIXL, never through Ray.

* :mod:`~staleflow_trainer.actors.rollout` — ``RolloutActor``: one engine adapter (vllm | sglang |
  sim); submit / poll / interrupt / sync (pull from the PS, load in place) / probe.
* :mod:`~staleflow_trainer.actors.param_host` — ``ParamServerHost``: owns the ``ParamServer`` and
  its NIXL storage worker processes.
* :mod:`~staleflow_trainer.actors.trainer_actor` — ``TrainerActor``: the PyTorch trainer; pushes
  every new version to the PS.
* :mod:`~staleflow_trainer.actors.reward_actor` — ``RewardActor``: runs the reward plug-in.
* :mod:`~staleflow_trainer.actors.coordinator_loop` — ``CoordinatorActor``: owns the staleness
  protocol and the rollout coordinator and runs the control loop.
"""
