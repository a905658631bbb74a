"""``staleflow train``: the whole disaggregated system on Ray, wired from one config.

Each component is its own Ray actor (see :mod:`staleflow_trainer.actors`): the trajectory server
(TCP on loopback with a token), the parameter server host (NIXL storage worker processes), N
rollout instances (one engine adapter each: vllm | sglang | sim), reward workers, the trainer,
and the coordinator loop that owns the staleness protocol and the rollout coordinator. The driver
(this module) only starts them, streams step records into the run directory and stops them.

Run directory (``run.run_dir``)::

    config.yaml            the resolved config
    model/                 the tiny model, when model.path is empty
    metrics.jsonl          one JSON object per training step (see staleflow_trainer.metrics)
    timeline.jsonl         per-instance busy / syncing / idle intervals
    tensorboard/           TensorBoard events
    checkpoints/step_<k>/  trainer.pt, trajectory_store.bin, coordinator.json (+ .sha256)
    checkpoints/latest     name of the newest complete checkpoint
    plots/                 PNGs (staleflow plot RUN_DIR)

Resuming (``run.resume``: ``auto`` = when a checkpoint exists, ``must``, ``never``): model,
optimizer, protocol state, trajectory store, data cursor and the loop's bookkeeping come back
exactly; trajectories that were on an instance at checkpoint time return to the queue with what
the store held (their V_traj and protocol reservations are kept).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import structlog

from staleflow_trainer.actors.coordinator_loop import (
    TS_FILE,
    latest_checkpoint,
)
from staleflow_trainer.config import AppConfig, dump_config, to_dict
from staleflow_trainer.errors import CheckpointError, ComponentLost, ConfigError
from staleflow_trainer.metrics import MetricsWriter, TimelineWriter
from staleflow_trainer.progress import ProgressBar, StartupProgress
from staleflow_trainer.startup import finished_run_message, ray_init_with_retry
from staleflow_trainer.trackers import trackers_from_config

log = structlog.get_logger(__name__)

_ENV = {
    # Ray >= 2.4x re-launches workers with `uv run` when the driver runs under `uv run`; in a
    # workspace that makes workers build a fresh environment without ray. Workers must use the
    # driver's interpreter (the locked .venv).
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@attrs.frozen(kw_only=True)
class RunSummary:
    """What a finished ``train`` run produced."""

    run_dir: str
    steps_done: int
    version: int
    wall_s: float
    metrics_path: str
    checkpoint: str | None
    resumed_from: str | None
    plots: tuple[str, ...] = ()
    counters: dict[str, int] = attrs.field(factory=dict)
    ledger: dict[str, Any] = attrs.field(factory=dict)


def resolve_resume(cfg: AppConfig) -> Path | None:
    """The checkpoint to resume from under ``run.resume`` (CheckpointError for ``must``
    without one)."""
    found = latest_checkpoint(cfg.run_dir)
    if cfg.run.resume == "never":
        return None
    if found is None and cfg.run.resume == "must":
        raise CheckpointError(
            f"run.resume=must but {cfg.run_dir / 'checkpoints'} holds no checkpoint",
            path=str(cfg.run_dir),
        )
    return found


def model_dir(cfg: AppConfig) -> Path:
    """``model.path``, or a tiny Qwen2 + character tokenizer created in ``RUN_DIR/model``."""
    from staleflow_trainer.tiny_model import resolve_model_path

    return resolve_model_path(cfg)


def preflight(cfg: AppConfig, model_path: Path) -> int:
    """Load and tokenize every prompt before anything starts: a missing column, an empty
    prompt or one longer than ``data.max_prompt_len`` (which fits the model context, see the
    config rules) is a DataError naming the row and field. Returns the number of prompts."""
    from transformers import AutoTokenizer

    from staleflow_trainer.data import encode_prompts, load_records
    from staleflow_trainer.errors import DataError

    records = load_records(cfg)
    tok = AutoTokenizer.from_pretrained(str(model_path))
    encoded = encode_prompts(
        records,
        tok,
        max_prompt_len=cfg.data.max_prompt_len,
        apply_chat_template=cfg.data.apply_chat_template,
        source=str(cfg.data.path) if cfg.data.path else None,
    )
    for rec, ids in zip(records, encoded, strict=True):
        if not ids:
            raise DataError(f"row {rec.index}: prompt encodes to no tokens", row=rec.index,
                            field="prompt")  # fmt: skip
    return len(records)


def _engine_kwargs(cfg: AppConfig, i: int, model_path: Path) -> dict[str, Any]:
    r = cfg.rollout
    if r.backend == "vllm":
        return {
            "model_path": str(model_path),
            "max_model_len": r.max_model_len,
            "max_num_seqs": r.max_running,
            "cpu_kv_cache_gib": max(1, round(r.kv_cache_gib)),
            "enforce_eager": r.enforce_eager,
            "dtype": cfg.model.dtype,
            "seed": cfg.run.seed + i,
        }
    if r.backend == "sim":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_path))
        s = cfg.sim
        cost: Any = s.cost_model
        if cost == "custom":
            cost = {"k1": s.k1, "k2": s.k2, "k3": s.k3, "k4": s.k4, "b": s.b or 0.0}
        return {
            "config": {
                "cost": cost,
                "max_running": r.max_running,
                "kv_capacity_tokens": s.kv_capacity_tokens,
                "max_model_len": r.max_model_len,
                "vocab_size": len(tok),
                "num_special_tokens": len(tok.all_special_ids) or 1,
                "eos_token_id": int(tok.eos_token_id or 0),
                "seed": cfg.run.seed + i,
            }
        }
    # sglang: attach to a running server (rollout.sglang_url, comma-separated: instance i takes
    # url i mod count). New versions go to it as safetensors through /update_weights_from_disk,
    # checked against the model's tensor shapes first.
    from engine_adapters.sglang import model_weight_shapes

    urls = [u for u in r.sglang_url.split(",") if u]
    if not urls:
        raise ConfigError(
            "rollout.backend=sglang needs rollout.sglang_url (the server address)",
            key="rollout.sglang_url",
            allowed="http://host:port[,http://host:port...]",
        )
    shapes = {k: list(v) for k, v in model_weight_shapes(model_path).items()}
    # Tied embeddings: the checkpoint has no lm_head.weight, but the trainer pushes it (as its
    # own copy); SGLang's loader skips it for tied models, so accept it with the tied shape.
    if "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return {
        "base_url": urls[i % len(urls)],
        "weights_dir": str(cfg.run_dir / "sglang-weights" / f"instance-{i}"),
        "weight_shapes": shapes,
    }


_RAY_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": node IP = loopback


def init_ray(cfg: AppConfig, progress: StartupProgress | None = None) -> bool:
    """Start a local Ray (or join ``ray.address``); returns True if this call started it.
    A start-up that times out is retried (:func:`ray_init_with_retry`); ``progress`` hears
    the retries."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    on_retry = None if progress is None else (lambda msg: progress.line("ray", msg))
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False  # read at import; ray may be imported

    if ray.is_initialized():
        return False
    if cfg.ray.address:
        os.environ.pop(_RAY_SINGLE_MACHINE, None)  # a local run in this process set it
        ray_constants.ENABLE_RAY_CLUSTER = not ray_constants.IS_WINDOWS_OR_OSX
        ray_init_with_retry(
            lambda: ray.init(
                address=cfg.ray.address,
                runtime_env={"env_vars": dict(_ENV)},
                log_to_driver=bool(os.environ.get("STALEFLOW_RAY_LOGS")),
            ),
            on_retry=on_retry,
        )
    else:
        # A local Ray advertises its node IP and binds its gRPC servers, raylet, object
        # manager and agents to it; Ray 2.60 resolves 127.0.0.1 to the external address unless
        # clustering is off (its single-machine mode), so turn it off: everything on loopback.
        os.environ[_RAY_SINGLE_MACHINE] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        ray_init_with_retry(
            lambda: ray.init(
                num_cpus=cfg.ray.num_cpus or os.cpu_count() or 1,
                num_gpus=cfg.ray.num_gpus or 0,
                include_dashboard=False,
                object_store_memory=cfg.ray.object_store_mb << 20,
                log_to_driver=bool(os.environ.get("STALEFLOW_RAY_LOGS")),
            ),
            on_retry=on_retry,
        )
    return True


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
        self._ps_addr: Any = None
        self._ps_token: str | None = None
        self._ts_addr: Any = None
        self._ts_token: str | None = None
        self._cfg_dict: dict[str, Any] = {}
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
        from trajectory_server.actor import TrajectoryServerActor

        cfg = self.cfg
        progress = self.startup
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resume_dir = resolve_resume(cfg)
        with progress.phase("model", "preparing the model and checking the prompts"):
            self.model_path = model_dir(cfg)
            preflight(cfg, self.model_path)  # bad data fails here: before Ray, nothing touched
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
            .options(num_cpus=0, max_concurrency=64)
            .remote(
                token=ts_token, checkpoint_path=str(ts_ckpt), restore=self.resume_dir is not None
            )
        )
        self.ps = (
            ray.remote(ParamServerHost)
            .options(num_cpus=0)
            .remote(
                num_workers=cfg.param_server.num_workers,
                keep_versions=max(cfg.param_server.keep_versions, 2),
                replication=cfg.param_server.replication,
                host=cfg.param_server.bind_host,
                token=ps_token,
            )
        )
        with progress.phase("servers", "starting the trajectory and parameter servers"):
            ts_addr, ps_addr = ray.get([self.ts.start.remote(), self.ps.address.remote()])
        n = cfg.rollout.num_instances
        self.trainer = (
            ray.remote(TrainerActor)
            .options(
                # 2 threads: push_failures() answers while a step retries a push
                **opts(n, num_cpus=0, num_gpus=cfg.trainer.num_gpus or 0, max_concurrency=2)
            )
            .remote(
                cfg=cfg_dict,
                model_path=str(self.model_path),
                ps_address=ps_addr,
                ps_token=ps_token,
                checkpoint_dir=None if self.resume_dir is None else str(self.resume_dir),
            )
        )
        self._ps_addr, self._ps_token = ps_addr, ps_token
        self._ts_addr, self._ts_token = ts_addr, ts_token
        self._cfg_dict, self._opts = cfg_dict, opts
        self.rollouts = dict(self._make_rollout(i, pg_index=i) for i in range(n))
        self._next_instance = n
        self.rewards = [
            ray.remote(RewardActor)
            .options(num_cpus=0)
            .remote(
                fn=cfg.reward.fn,
                retries=cfg.reward.retries,
                timeout_s=cfg.reward.timeout_s,
                tokenizer_path=str(self.model_path),
            )
            for _ in range(cfg.reward.num_workers)
        ]
        starts = {iid: h.start.remote() for iid, h in self.rollouts.items()}
        pushed = self.trainer.push.remote()  # version 0, or the resumed version
        progress.line(
            "engines", f"starting {n} {cfg.rollout.backend} engine(s): {', '.join(starts)}"
        )
        infos = list(progress.wait_each("engines", starts).values())
        with progress.phase("trainer", "loading the model and publishing its first version"):
            version = int(ray.get(pushed)["version"])
        if version > 0:  # resumed: every instance serves the trainer's version first
            ray.get([h.sync.remote(version) for h in self.rollouts.values()])
        instances = {
            i["instance_id"]: {"kv_capacity_tokens": i["kv_capacity_tokens"]} for i in infos
        }
        self.coordinator = self._make_coordinator(
            instances, resume_dir=None if self.resume_dir is None else str(self.resume_dir)
        )
        with progress.phase("coordinator", "setting up the protocol and the coordinator"):
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

    def _make_rollout(self, i: int, *, pg_index: int | None = None) -> tuple[str, Any]:
        import ray

        from staleflow_trainer.actors.rollout import RolloutActor

        cfg = self.cfg
        assert self._opts is not None and self.model_path is not None
        iid = f"{cfg.rollout.backend}-{i}"
        handle = (
            ray.remote(RolloutActor)
            .options(
                **self._opts(
                    pg_index,
                    num_cpus=cfg.rollout.cpus_per_instance,
                    num_gpus=cfg.rollout.gpus_per_instance,
                    max_concurrency=1000,
                )
            )
            .remote(
                instance_id=iid,
                backend=cfg.rollout.backend,
                engine_kwargs=_engine_kwargs(cfg, i, self.model_path),
                ps_address=self._ps_addr,
                ps_token=self._ps_token,
            )
        )
        return iid, handle

    def _make_coordinator(
        self,
        instances: dict[str, dict[str, Any]],
        *,
        resume_dir: str | None = None,
        handover_state: dict[str, Any] | None = None,
        recover: bool = False,
    ) -> Any:
        import ray

        from staleflow_trainer.actors.coordinator_loop import CoordinatorActor

        return (
            ray.remote(CoordinatorActor)
            .options(num_cpus=0, max_concurrency=64)
            .remote(
                cfg=self._cfg_dict,
                model_path=str(self.model_path),
                ts_address=self._ts_addr,
                ts_token=self._ts_token,
                rollouts=self.rollouts,
                instances=instances,
                trainer=self.trainer,
                rewards=self.rewards,
                resume_dir=resume_dir,
                handover_state=handover_state,
                recover=recover,
            )
        )

    # ------------------------------------------------------------------------- faults

    def kill_instance(self, instance_id: str) -> None:
        """Kill a rollout instance's process (``ray.kill``); the loop notices at its next call
        to it, returns its work to the queue and stops routing to it."""
        import ray

        ray.kill(self.rollouts.pop(instance_id), no_restart=True)

    def add_instance(self) -> str:
        """Start a new rollout instance, load the latest published version from the param
        server, and let it join the running loop; returns its id. (With GPUs it is placed by
        Ray outside the placement group.)"""
        import ray

        iid, handle = self._make_rollout(self._next_instance)
        self._next_instance += 1
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

    def restart_coordinator(self) -> dict[str, Any]:
        """Replace the coordinator actor: the old one stops and hands over its live state
        (protocol + bookkeeping), its process is killed, and a new one rebuilds its view from
        that state, the trajectory server and fresh instance snapshots. ``run()`` carries on
        with the new one. Returns the new actor's set-up info."""
        import ray

        old = self.coordinator
        state = ray.get(old.handover.remote())
        self._pending_out.append(ray.get(old.drain.remote()))
        live = set(ray.get(old.instances.remote()))
        ray.kill(old, no_restart=True)
        for iid in [i for i in self.rollouts if i not in live]:
            self.rollouts.pop(iid)  # lost while the old loop ran
        infos = ray.get([h.start.remote() for h in self.rollouts.values()])
        instances = {
            i["instance_id"]: {
                "kv_capacity_tokens": i["kv_capacity_tokens"],
                "version": i["version"],
            }
            for i in infos
        }
        self.coordinator = self._make_coordinator(instances, handover_state=state)
        info = dict(ray.get(self.coordinator.setup.remote()))
        log.info("coordinator_restarted", **info)
        return info

    def replace_crashed_coordinator(self, error: BaseException | None = None) -> dict[str, Any]:
        """The coordinator actor died without handing over (crash, ``ray.kill``): start a new
        one that replays the write-ahead journal and reconciles the TS, the instances and the
        trainer with it (``CoordinatorActor(recover=True)``). At most
        ``run.coordinator_restarts`` times per deployment; then :class:`ComponentLost`
        (restart the app from its last checkpoint). Returns the new actor's set-up info."""
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
        refs = {iid: h.start.remote() for iid, h in self.rollouts.items()}
        instances: dict[str, dict[str, Any]] = {}
        for iid, ref in refs.items():
            try:
                i = ray.get(ref)
            except Exception as e:  # lost too: the TS still shows its work; recovery requeues it
                log.warning("instance_gone_at_coordinator_restart", instance=iid, error=repr(e))
                self.rollouts.pop(iid)
                continue
            instances[iid] = {
                "kv_capacity_tokens": i["kv_capacity_tokens"],
                "version": i["version"],
            }
        self.coordinator = self._make_coordinator(instances, recover=True)
        info = dict(ray.get(self.coordinator.setup.remote()))
        info["restart_s"] = time.monotonic() - t0
        info["error"] = repr(error)[:300]
        self.coordinator_crashes.append(info)
        log.warning("coordinator_replaced_after_crash", **info)
        return info

    def hold_between_steps(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Hold the coordinator loop right after its next training step completes (record
        committed, checkpoint written if due, no other step started) and return where it holds;
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
        import ray
        from ray.util.placement_group import placement_group

        bundles = [
            {"CPU": cfg.rollout.cpus_per_instance, "GPU": cfg.rollout.gpus_per_instance}
            for _ in range(cfg.rollout.num_instances)
        ]
        bundles.append({"CPU": 0.01, "GPU": float(cfg.trainer.num_gpus)})
        pg = placement_group(bundles, strategy="PACK")
        ray.get(pg.ready())
        return pg

    # ------------------------------------------------------------------------------- run

    def run(self, on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Drive the coordinator loop until ``trainer.steps``; writes metrics and timeline."""
        import ray

        cfg = self.cfg
        resumed = self.resume_dir is not None
        writer = MetricsWriter(
            self.run_dir,
            tensorboard=cfg.metrics.tensorboard,
            resume_step=self.steps_at_start if resumed else None,
            trackers=trackers_from_config(cfg, resume=resumed),
        )
        timeline = TimelineWriter(self.run_dir)
        coord: Any = None
        run_ref: Any = None
        last_step = self.steps_at_start
        summary: Any = None

        def emit(outs: list[dict[str, Any]], bar: Any) -> None:
            nonlocal last_step
            for out in outs:
                for rec in out["records"]:
                    if int(rec["step"]) <= last_step:
                        continue  # re-sent by a coordinator recovered from its journal
                    last_step = int(rec["step"])
                    writer.log_step(rec)
                    if bar is not None:
                        bar.update(int(rec["step"]), rec)
                    if on_record is not None:
                        on_record(rec)
                timeline.extend(out["timeline"])

        try:
            with ProgressBar(
                cfg.trainer.steps,
                enabled=cfg.metrics.progress_bar,
                start_step=self.steps_at_start,
                log_every=cfg.metrics.log_every,
            ) as bar:
                while True:
                    if coord is not self.coordinator:  # started, or replaced
                        coord = self.coordinator
                        run_ref = coord.run.remote()
                    ready, _ = ray.wait([run_ref], timeout=0.5)
                    outs, self._pending_out = self._pending_out, []
                    try:
                        outs.append(ray.get(coord.drain.remote()))
                    except Exception as e:
                        if not _is_actor_death(e) or coord is not self.coordinator:
                            raise
                        emit(outs, bar)
                        self.replace_crashed_coordinator(e)
                        continue
                    emit(outs, bar)
                    if ready and coord is self.coordinator:
                        try:
                            summary = ray.get(run_ref)
                        except Exception as e:  # ComponentLost etc. propagate
                            if not _is_actor_death(e):
                                raise
                            self.replace_crashed_coordinator(e)
                            continue
                        break
            emit([ray.get(coord.drain.remote())], None)
        finally:
            writer.close()
            timeline.close()
        return dict(summary)

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
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_actor_death(e: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (RayActorError, ActorDiedError, ActorUnavailableError))


def train(cfg: AppConfig, *, command: str = "staleflow train CONFIG") -> RunSummary | None:
    """Run ``staleflow train``: start everything, train ``trainer.steps`` steps, stop, plot.
    A run directory that already holds a finished run is reported and left alone (None)."""
    finished = finished_run_message(cfg, command=command)
    if finished is not None:
        from rich.console import Console

        Console().print(finished, markup=False, highlight=False, soft_wrap=True)
        return None
    t0 = time.monotonic()
    dep = Deployment(cfg)
    try:
        dep.start()
        summary = dep.run()
        ledger = dep.ledger()
    finally:
        dep.close()
    plots: tuple[str, ...] = ()
    try:
        from staleflow_trainer.plots import plot_run

        plots = tuple(str(p) for p in plot_run(cfg.run_dir))
    except Exception as e:  # plots are a convenience; the run itself succeeded
        log.warning("plots_failed", error=repr(e))
    ckpt = latest_checkpoint(cfg.run_dir)
    result = RunSummary(
        run_dir=str(cfg.run_dir),
        steps_done=int(summary["steps_done"]),
        version=int(summary["version"]),
        wall_s=time.monotonic() - t0,
        metrics_path=str(cfg.run_dir / "metrics.jsonl"),
        checkpoint=None if ckpt is None else str(ckpt),
        resumed_from=None if dep.resume_dir is None else str(dep.resume_dir),
        plots=plots,
        counters=dict(summary["counters"]),
        ledger=ledger,
    )
    (cfg.run_dir / "summary.json").write_text(json.dumps(attrs.asdict(result), indent=1))
    _report(result)
    return result


def _report(s: RunSummary) -> None:
    from rich.console import Console

    c = Console()
    c.print(
        f"[bold green]done[/]: {s.steps_done} steps (version {s.version}) in {s.wall_s:.0f} s"
        + (f", resumed from {s.resumed_from}" if s.resumed_from else "")
    )
    c.print(f"run directory: {s.run_dir}")
    c.print(f"metrics:       {s.metrics_path}")
    if s.checkpoint:
        c.print(f"checkpoint:    {s.checkpoint}")
    if s.plots:
        c.print(
            f"plots:         {Path(s.plots[0]).parent}  ({', '.join(Path(p).name for p in s.plots)})"
        )
    tb = Path(s.run_dir) / "tensorboard"
    if tb.is_dir():
        c.print(f"tensorboard:   {tb}  (view it: tensorboard --logdir {tb})", soft_wrap=True)
    if s.ledger.get("problems"):
        c.print(f"[bold red]ledger problems[/]: {s.ledger['problems'][:5]}")


def profile(cfg: AppConfig, *, steps: int = 8) -> int:
    """``staleflow profile``: measure one engine's per-step decode latency on a grid of
    (running, KV tokens) points; writes ``RUN_DIR/profile.jsonl`` (the input of
    ``staleflow fit-cost-model``). Runs in this process, no Ray."""
    import asyncio

    from engine_adapters import create_engine, write_profile_jsonl

    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir(cfg)
    r = cfg.rollout
    per_traj = sorted({max(steps, (r.max_model_len - steps) // 2), r.max_model_len - steps})
    running = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= r.max_running]
    points = [(n, n * length) for n in running for length in per_traj]

    async def measure() -> list[Any]:
        engine = create_engine(r.backend, instance_id="profile-0", **_engine_kwargs(cfg, 0, path))
        await engine.start()
        try:
            # warm-up, discarded: an engine's first decode steps pay one-off costs (on vLLM-CPU
            # the first point once read 14x slower than its neighbour and broke the fit)
            await engine.profile(points[:1], steps=steps)
            return list(await engine.profile(points, steps=steps))
        finally:
            await engine.close()

    measured = asyncio.run(measure())
    out = cfg.run_dir / "profile.jsonl"
    out.unlink(missing_ok=True)
    write_profile_jsonl(measured, out)
    from rich.console import Console

    Console().print(
        f"{len(measured)} profile points -> {out}\n"
        f"fit them with: staleflow fit-cost-model {out} -o {cfg.run_dir / 'cost_model.json'}"
    )
    return 0
