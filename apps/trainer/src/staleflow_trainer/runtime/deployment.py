"""The running system on Ray: :class:`Deployment` starts one actor per component from one
config — the trajectory server, the parameter server host, the rollout instances, the reward
workers, the trainer and the control actor (the Ray shell of the control core) — drives the
control actor until the run is done, streams step records into the run directory, replaces a
control actor that died, and stops everything. ``staleflow train`` is
:func:`staleflow_trainer.runtime.wiring.train` over it; the integration tests use its handles.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.actors.liveness import kill_actor, unresponsive_actors
from staleflow_trainer.actors.reconcile import TS_FILE
from staleflow_trainer.atomic_files import make_run_dir
from staleflow_trainer.config import AppConfig, dump_config, is_loopback, to_dict
from staleflow_trainer.errors import ComponentLost
from staleflow_trainer.report.progress import StartupProgress
from staleflow_trainer.runtime.prepare import (
    check_local_cpus,
    init_ray,
    model_dir,
    placement_hint,
    preflight,
    ray_prints_worker_logs,
    resolve_resume,
    role_options,
    rollout_kwargs,
    verify_checkpoint,
)
from staleflow_trainer.runtime.replacements import Replacer

log = structlog.get_logger(__name__)

#: How long actors may take to start (engines load models) before the run gives up.
START_TIMEOUT_S = 900.0


class Deployment:
    """The running system. ``start()`` → ``run()`` → ``close()``; tests use the handles.

    Actor handles: ``ts``, ``ps``, ``trainer``, ``rollouts`` (instance id → handle),
    ``rewards``, ``coordinator``.
    """

    def __init__(self, cfg: AppConfig) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.resume_dir: Path | None = None
        self.model_path: Path | None = None
        self.ts: Any = None
        self.ps: Any = None
        self.trainer: Any = None
        self.rollouts: dict[str, Any] = {}
        self.rewards: list[Any] = []
        self.coordinator: Any = None
        self.steps_at_start = 0
        self.coordinator_crashes: list[dict[str, Any]] = []  # replaced after a crash
        self._pending_out: list[dict[str, Any]] = []
        self._next_instance = 0
        self._bundles: dict[str, int | None] = {}  # instance -> its placement-group bundle
        self._slots: dict[str, int] = {}  # instance -> the instance number of its engine settings
        self.replacer: Replacer | None = None  # replaces lost instances while run() runs
        self._ps_addr: Any = None
        self._ps_token: str | None = None
        self._ts_addr: Any = None
        self._ts_token: str | None = None
        self._cfg_dict: dict[str, Any] = {}
        self._prompt_lengths: Any = None  # in Ray's object store: what the control process takes
        self._decoder: Any = None  # the tokenizer's backend there, for reward workers, or None
        self._opts: Callable[..., dict[str, Any]] | None = None
        self._started_ray = False
        self._t0 = time.monotonic()
        self.startup = StartupProgress()  # start-up phase lines with elapsed seconds

    # ------------------------------------------------------------------------------ start

    def start(self) -> Deployment:
        import ray

        from staleflow_trainer.actors.param_host import ParamServerHost
        from staleflow_trainer.actors.reward_actor import RewardActor
        from staleflow_trainer.actors.trainer_actor import TrainerActor
        from staleflow_trainer.actors.ts_actor import TrajectoryServerActor

        cfg = self.cfg
        progress = self.startup
        make_run_dir(self.run_dir)
        check_local_cpus(cfg)
        self.resume_dir = resolve_resume(cfg)
        with progress.phase("model", "preparing the model and checking the prompts"):
            self.model_path = model_dir(cfg)
            prompts, decoder = preflight(cfg, self.model_path)  # bad data fails here
            if self.resume_dir is not None:  # so does a damaged checkpoint
                verify_checkpoint(self.resume_dir, rows=len(prompts))
        ckpt_root = self.run_dir / "checkpoints"
        ts_ckpt = ckpt_root / TS_FILE
        if self.resume_dir is None:
            shutil.rmtree(ckpt_root, ignore_errors=True)
            for name in ("timeline.jsonl",):
                (self.run_dir / name).unlink(missing_ok=True)
        else:
            shutil.copyfile(self.resume_dir / TS_FILE, ts_ckpt)
        ckpt_root.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.run_dir / "config.yaml")
        ray_what = f"joining {cfg.ray.address}" if cfg.ray.address else "starting a local Ray"
        with progress.phase("ray", ray_what):
            self._started_ray = init_ray(cfg, progress)
        # the TS takes the prompts, the control process their lengths: no dataset, no tokenizer
        self._prompt_lengths = ray.put(prompts.lengths())
        # the reward workers decode with the tokenizer's backend when it decodes alike (no
        # transformers in them); None: they load the tokenizer
        self._decoder = None if decoder is None else ray.put(decoder)
        cfg_dict = to_dict(cfg)
        pg = self._placement_group()

        def opts(i: int | None, **kw: Any) -> dict[str, Any]:
            if pg is not None and i is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                kw["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                )
            return kw

        ts_token = secrets.token_hex(16)
        ps_token = cfg.param_server.auth_token or secrets.token_hex(16)
        self.ts = (
            ray.remote(TrajectoryServerActor)
            .options(**role_options(cfg, "control", num_cpus=0, max_concurrency=64))
            .remote(
                token=ts_token, checkpoint_path=str(ts_ckpt), restore=self.resume_dir is not None
            )
        )
        self.ps = (
            ray.remote(ParamServerHost)
            .options(**role_options(cfg, "control", num_cpus=0))
            .remote(
                num_workers=cfg.param_server.num_workers,
                keep_versions=max(cfg.param_server.keep_versions, 2),
                replication=cfg.param_server.replication,
                host=cfg.param_server.bind_host,
                token=ps_token,
            )
        )
        ts_host = cfg.ray.trajectory_server_host
        with progress.phase("servers", "starting the trajectory and parameter servers"):
            # the prompt table: groups go by row, no prompt passes through the control process
            ts_addr, ps_addr, _ = ray.get(
                [
                    self.ts.start.remote(host=ts_host, allow_remote=not is_loopback(ts_host)),
                    self.ps.address.remote(),
                    self.ts.load_prompts.remote(prompts),  # then gone from the object store
                ]
            )
        self._ps_addr, self._ps_token = ps_addr, ps_token
        self._ts_addr, self._ts_token = ts_addr, ts_token
        self._cfg_dict, self._opts = cfg_dict, opts
        n = cfg.rollout.num_instances
        self.trainer = (
            ray.remote(TrainerActor)
            .options(
                # 4 threads: push_failures() answers while a step retries a push, and
                # streamed-in parts (trainer.stream_batch) may wait for the step before them
                **opts(
                    n,
                    **role_options(
                        cfg,
                        "trainer",
                        num_cpus=0,
                        num_gpus=cfg.trainer.num_gpus or 0,
                        max_concurrency=4,
                    ),
                )
            )
            .remote(
                cfg=cfg_dict,
                model_path=str(self.model_path),
                ps_address=ps_addr,
                ps_token=ps_token,
                checkpoint_dir=None if self.resume_dir is None else str(self.resume_dir),
                ts_address=ts_addr,
                ts_token=ts_token,
            )
        )
        self.rollouts = dict(self._make_rollout(i, pg_index=i) for i in range(n))
        self._next_instance = n
        self.rewards = [
            ray.remote(RewardActor)
            .options(**role_options(cfg, "reward", num_cpus=0))
            .remote(**self._reward_spec())
            for _ in range(cfg.reward.num_workers)
        ]
        starts = {iid: h.start.remote() for iid, h in self.rollouts.items()}
        pushed = self.trainer.push.remote()  # version 0, or the resumed version
        # the control process starts (and imports) while the engines and the trainer do; its
        # set-up waits for them below
        self.coordinator = self._make_coordinator(
            resume_dir=None if self.resume_dir is None else str(self.resume_dir)
        )
        progress.line(
            "engines", f"starting {n} {cfg.rollout.backend} engine(s): {', '.join(starts)}"
        )
        try:
            progress.wait_each("engines", starts, timeout_s=START_TIMEOUT_S)
        except TimeoutError:  # name what the cluster lacks
            self._await_started(list(starts.values()), "rollout instances",
                                {"CPU": cfg.rollout.cpus_per_instance,
                                 "GPU": cfg.rollout.gpus_per_instance or 0.0},
                                timeout_s=0)  # fmt: skip
        with progress.phase("trainer", "loading the model and publishing its first version"):
            self._await_started([pushed], "the trainer",
                                {"GPU": float(cfg.trainer.num_gpus or 0)})  # fmt: skip
            version = int(ray.get(pushed)["version"])
        if version > 0:  # resumed: every instance serves the trainer's version first
            ray.get([h.sync.remote(version) for h in self.rollouts.values()])
        with progress.phase("control", "setting up the control core"):
            info = ray.get(self.coordinator.setup.remote())
        self.steps_at_start = int(info["steps_done"])
        log.info(
            "deployment_started",
            instances=list(self.rollouts),
            version=version,
            resumed_from=None if self.resume_dir is None else str(self.resume_dir),
            seconds=round(time.monotonic() - self._t0, 1),
        )
        return self

    def _await_started(
        self,
        refs: list[Any],
        what: str,
        need: dict[str, float],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Wait for actors' start-up calls; after :data:`START_TIMEOUT_S` a ComponentLost
        naming the resources the cluster lacks (actors Ray cannot place wait forever)."""
        import ray

        wait_s = START_TIMEOUT_S if timeout_s is None else timeout_s
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        if pending:
            raise ComponentLost(
                f"{len(pending)} of {len(refs)} {what} did not start within {START_TIMEOUT_S:g} s"
                + placement_hint(need, len(refs)),
                component=what,
            )
        ray.get(refs)  # a start-up that failed raises here

    def _make_rollout(
        self, i: int, *, pg_index: int | None = None, slot: int | None = None
    ) -> tuple[str, Any]:
        """Rollout actor ``{backend}-{i}`` (not started) on bundle ``pg_index``; ``slot``: the
        engine settings of that instance number (a replacement's: the lost one's server,
        seed and speed), else ``i``'s."""
        import ray

        from staleflow_trainer.actors.rollout import RolloutActor

        cfg = self.cfg
        assert self._opts is not None and self.model_path is not None
        iid = f"{cfg.rollout.backend}-{i}"
        slot = i if slot is None else slot
        self._bundles[iid] = pg_index
        self._slots[iid] = slot
        handle = (
            ray.remote(RolloutActor)
            .options(
                **self._opts(
                    pg_index,
                    **role_options(
                        cfg,
                        "rollout",
                        num_cpus=cfg.rollout.cpus_per_instance,
                        num_gpus=cfg.rollout.gpus_per_instance,
                        max_concurrency=1000,
                    ),
                )
            )
            .remote(
                instance_id=iid,
                **rollout_kwargs(cfg, slot, self.model_path),
                ts_address=self._ts_addr,
                ts_token=self._ts_token,
                ps_address=self._ps_addr,
                ps_token=self._ps_token,
                generate_error_limit=cfg.coordinator.generate_error_limit,
                store_timeout_s=cfg.coordinator.store_wait_s,
            )
        )
        return iid, handle

    def _reward_spec(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "fn": cfg.reward.fn,
            "retries": cfg.reward.retries,
            "timeout_s": cfg.reward.timeout_s,
            "tokenizer_path": str(self.model_path),
            "decoder": self._decoder,
            "ts_address": self._ts_addr,
            "ts_token": self._ts_token,
        }

    def _make_coordinator(self, *, resume_dir: str | None = None, recover: bool = False) -> Any:
        import ray

        from staleflow_trainer.actors.control import ControlActor

        return (
            ray.remote(ControlActor)
            .options(**role_options(self.cfg, "control", num_cpus=0, max_concurrency=64))
            .remote(
                cfg=self._cfg_dict,
                prompts=self._prompt_lengths,
                ts_address=self._ts_addr,
                ts_token=self._ts_token,
                rollouts=self.rollouts,
                trainer=self.trainer,
                rewards=self.rewards,
                reward_spec=self._reward_spec(),
                resume_dir=resume_dir,
                recover=recover,
                driver_pid=self._driver_pid_for_control(),
                relay_logs=not ray_prints_worker_logs(),  # else Ray prints its lines
            )
        )

    def _driver_pid_for_control(self) -> int | None:
        """This pid if the control actor runs on this node (a local Ray): it stops once gone."""
        return None if self.cfg.ray.address else os.getpid()

    # ------------------------------------------------------------------------- faults

    def kill_instance(self, instance_id: str) -> None:
        """Kill a rollout instance's process (``ray.kill``); the loop notices at its next call
        to it, returns its work to the queue and stops routing to it."""
        kill_actor(self.rollouts.pop(instance_id))

    def add_instance(self) -> str:
        """Start a new rollout instance, load the latest published version from the param
        server, and let it join the running loop; returns its id. (With GPUs it is placed by
        Ray outside the placement group.)"""
        import ray

        iid, handle = self.new_rollout()
        info = ray.get(handle.start.remote())
        version = int(ray.get(handle.sync.remote(None))["version"])
        ray.get(
            self.coordinator.add_instance.remote(
                iid, handle, kv_capacity_tokens=int(info["kv_capacity_tokens"]), version=version
            )
        )
        self.rollouts[iid] = handle
        log.info("instance_added", instance=iid, version=version)
        return iid

    def new_rollout(self, bundle_of: str | None = None) -> tuple[str, Any]:
        """A new rollout actor under the next free id, not started; ``bundle_of``: in place of
        that (lost) instance, on its placement-group bundle and with its engine settings (else,
        with GPUs, placed outside the group)."""
        key = bundle_of or ""
        iid, handle = self._make_rollout(
            self._next_instance, pg_index=self._bundles.get(key), slot=self._slots.get(key)
        )
        self._next_instance += 1
        return iid, handle

    def restart_coordinator(self) -> dict[str, Any]:
        """Replace the control actor on purpose: the old one is stopped (its last events are
        journaled) and killed, and a new one recovers from the write-ahead journal exactly as
        after a crash. ``run()`` carries on with the new one. Returns its set-up info."""
        import ray

        old = self.coordinator
        try:
            ray.get(old.stop.remote(), timeout=60)
            self._pending_out.append(ray.get(old.drain.remote(), timeout=60))
        except Exception as e:  # already gone: recovery covers it
            log.warning("control_stop_failed", error=repr(e)[:200])
        kill_actor(old)
        self.coordinator = self._make_coordinator(recover=True)
        info = dict(ray.get(self.coordinator.setup.remote()))
        log.info("coordinator_restarted", **info)
        return info

    def replace_crashed_coordinator(self, error: BaseException | None = None) -> dict[str, Any]:
        """The control actor died (crash, ``ray.kill``): start a new one that replays the
        write-ahead journal and reconciles the trajectory server, the instances and the trainer
        with it. At most ``run.coordinator_restarts`` times per deployment; then
        :class:`ComponentLost` (restart the app from its last checkpoint)."""
        import ray

        limit = self.cfg.run.coordinator_restarts
        if len(self.coordinator_crashes) >= limit:
            raise ComponentLost(
                f"the coordinator died again after {len(self.coordinator_crashes)} replacement(s);"
                f" run.coordinator_restarts={limit} is exhausted — restart the app from its last "
                f"checkpoint (run.resume=must): {error!r:.300}",
                component="coordinator",
            )
        t0 = time.monotonic()
        ray.kill(self.coordinator, no_restart=True)  # make sure: it must not write any more
        # an instance lost too: recovery requeues what the store shows it held
        limit_s = self.cfg.coordinator.call_timeout_s
        for iid, why in unresponsive_actors(self.rollouts, limit_s).items():
            log.warning("instance_gone_at_coordinator_restart", instance=iid, error=why)
            self.rollouts.pop(iid)
        self.coordinator = self._make_coordinator(recover=True)
        info = dict(ray.get(self.coordinator.setup.remote()))
        info["restart_s"] = time.monotonic() - t0
        info["error"] = repr(error)[:300]
        self.coordinator_crashes.append(info)
        log.warning("coordinator_replaced_after_crash", **info)
        return info

    def hold_between_steps(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Hold the coordinator loop right after its next training step completes (record
        committed, checkpoint written if due — the last step's is written once the run has
        stopped — no other step started) and return where it holds;
        :meth:`release_hold` lets it go on. Fault tests kill the trainer in between."""
        import ray

        ray.get(self.coordinator.hold_after_next_step.remote())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            held = ray.get(self.coordinator.held.remote())
            if held is not None:
                return dict(held)
            time.sleep(0.05)
        raise TimeoutError(f"the loop completed no training step within {timeout_s} s")

    def release_hold(self) -> None:
        import ray

        ray.get(self.coordinator.release_hold.remote())

    def _placement_group(self) -> Any:
        cfg = self.cfg
        if not (cfg.rollout.gpus_per_instance or cfg.trainer.num_gpus):
            return None
        from ray.util.placement_group import placement_group

        bundles = [
            {"CPU": cfg.rollout.cpus_per_instance, "GPU": cfg.rollout.gpus_per_instance}
            for _ in range(cfg.rollout.num_instances)
        ]
        bundles.append({"CPU": 0.01, "GPU": float(cfg.trainer.num_gpus)})
        pg = placement_group(bundles, strategy="PACK")
        total = {k: sum(b[k] for b in bundles) for k in ("CPU", "GPU")}
        self._await_started([pg.ready()], "placement group (instances + trainer)", total)
        return pg

    # ------------------------------------------------------------------------------- run

    def run(self, on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Drive the coordinator loop until ``trainer.steps``; writes metrics and timeline
        (:func:`~staleflow_trainer.runtime.drive.drive`)."""
        from staleflow_trainer.runtime.drive import drive

        return drive(self, on_record)

    # ------------------------------------------------------------------------- queries

    def ledger(self) -> dict[str, Any]:
        import ray

        return dict(ray.get(self.coordinator.ledger.remote()))

    def protocol_state(self) -> dict[str, Any]:
        import ray

        return dict(ray.get(self.coordinator.protocol_state.remote()))

    # ------------------------------------------------------------------------------ stop

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        closing = [h.close.remote() for h in self.rollouts.values()]
        if self.trainer is not None:
            closing.append(self.trainer.close.remote())
        if self.ps is not None:
            closing.append(self.ps.close.remote())
        for ref in closing:  # one dead component must not keep the others from closing
            try:
                ray.get(ref, timeout=60)
            except Exception as e:  # shutting down anyway
                log.warning("close_incomplete", error=repr(e)[:300])
        for h in [
            self.coordinator,
            *self.rollouts.values(),
            *self.rewards,
            self.trainer,
            self.ps,
            self.ts,
        ]:
            if h is not None:
                ray.kill(h)
        self.rollouts, self.rewards = {}, []
        self.coordinator = self.trainer = self.ps = self.ts = None
        self._prompt_lengths = self._decoder = None  # their copies in the object store go too
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
