"""What a deployment is built from, before any of its actors starts: Ray (local or an existing
cluster) and where each role's actors go, the model directory, the checkpoint a run resumes
from, the preflight checks, and each rollout instance's engine arguments."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from staleflow_trainer.actors.reconcile import STATE_FILE, latest_checkpoint
from staleflow_trainer.config import AppConfig, is_loopback
from staleflow_trainer.data.tokenize import EncodedPrompts
from staleflow_trainer.errors import CheckpointError, ConfigError
from staleflow_trainer.report.progress import StartupProgress
from staleflow_trainer.runtime.startup import ray_init_with_retry

log = structlog.get_logger(__name__)

WORKER_ENV = {
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


def resolve_resume(cfg: AppConfig) -> Path | None:
    """The checkpoint to resume from under ``run.resume`` (CheckpointError for ``must``
    without one)."""
    if cfg.run.resume == "never":
        return None
    found = latest_checkpoint(cfg.run_dir)
    if found is None and cfg.run.resume == "must":
        raise CheckpointError(
            f"run.resume=must but {cfg.run_dir / 'checkpoints'} holds no checkpoint",
            path=str(cfg.run_dir),
        )
    if found is not None:
        check_checkpoint_protocol(cfg, found)
    return found


def check_checkpoint_protocol(cfg: AppConfig, ckpt: Path) -> None:
    """Refuse, before anything is deployed, a resume whose config would run the checkpoint's
    protocol under different rules (see
    :func:`~staleflow_trainer.control.config.check_resumable`)."""

    from staleflow_trainer.atomic_files import read_verified_bytes
    from staleflow_trainer.control.config import check_resumable, core_config
    from staleness_protocol import protocol_from_dict

    state = json.loads(read_verified_bytes(ckpt / STATE_FILE))
    check_resumable(protocol_from_dict(state["protocol"]), core_config(cfg, rows=None).protocol)


def verify_checkpoint(ckpt: Path, *, rows: int) -> None:
    """Read and check every file of the checkpoint a run resumes from, before anything starts
    (a CheckpointError naming the file, instead of an actor dying minutes into start-up): the
    core state, the trainer's and the trajectory store's files verify, and the data cursor
    covers the dataset as it is now (``rows`` prompts)."""
    from staleflow_trainer.actors.reconcile import TRAINER_FILE, TS_FILE
    from staleflow_trainer.atomic_files import read_verified_bytes
    from trajectory_server.checkpoint import load_checkpoint

    try:
        state = json.loads(read_verified_bytes(ckpt / STATE_FILE))
        cursor_rows = state["feed"]["rows"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{ckpt / STATE_FILE} is not a control state: {e!r:.200}", path=str(ckpt)
        ) from None
    read_verified_bytes(ckpt / TRAINER_FILE)
    try:
        load_checkpoint(ckpt / TS_FILE)
    except Exception as e:  # the TS package's CheckpointError, or a decode failure
        raise CheckpointError(
            f"{ckpt / TS_FILE}: {type(e).__name__}: {e}", path=str(ckpt / TS_FILE)
        ) from None
    if cursor_rows != rows:
        raise CheckpointError(
            f"{ckpt} was written for a dataset of {cursor_rows} prompts; the configured dataset "
            f"has {rows}: resume with the same data, or start a new run (run.resume=never)",
            path=str(ckpt),
        )


def model_dir(cfg: AppConfig) -> Path:
    """``model.path``, or a tiny Qwen2 + character tokenizer created in ``RUN_DIR/model``."""
    from staleflow_trainer.tiny_model import resolve_model_path

    return resolve_model_path(cfg)


def preflight(cfg: AppConfig, model_path: Path) -> tuple[EncodedPrompts, str | None]:
    """Load and tokenize every prompt before anything starts: a missing column, an empty
    prompt or one longer than ``data.max_prompt_len`` (which fits the model context, see the
    config rules) is a DataError naming the row and field. Returns the prompts encoded, for
    the control process (which then loads neither the dataset nor a tokenizer), and the
    tokenizer's backend for the reward workers to decode responses with, None where it does
    not decode as the tokenizer does (``reward.decode.portable_backend``)."""
    from transformers import AutoTokenizer

    from staleflow_trainer.data import encode_records
    from staleflow_trainer.errors import RewardError
    from staleflow_trainer.reward.decode import portable_backend
    from staleflow_trainer.reward.plugin import load_reward_fn

    try:  # a reward function that cannot be imported fails here, not in every worker
        load_reward_fn(cfg.reward.fn)
    except RewardError as e:
        raise ConfigError(f"reward.fn: {e}", key="reward.fn",
                          allowed="an importable 'pkg.module:function'") from e  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(model_path))
    prompts = encode_records(cfg, tok)
    backend = portable_backend(tok, (prompts.ids(i) for i in range(len(prompts))))
    log.debug("reward_decoding", backend="tokenizers" if backend else "transformers")
    return prompts, backend


def rollout_kwargs(cfg: AppConfig, i: int, model_path: Path) -> dict[str, Any]:
    """What rollout instance ``i`` is built with (``RolloutActor``): its backend, its engine's
    arguments and, for sim engines, the workload's response lengths (it draws each
    trajectory's from its id; the same as ``staleflow simulate`` gives that group)."""
    lengths = None
    if cfg.rollout.backend == "sim":
        from staleflow_trainer.sim.workload import engine_lengths

        lengths = engine_lengths(cfg)
    return {
        "backend": cfg.rollout.backend,
        "engine_kwargs": engine_kwargs(cfg, i, model_path),
        "lengths": lengths,
    }


def _token_facts(model_path: str) -> tuple[int, int, int]:
    """The tokenizer's vocabulary size, special-token count (at least 1) and end-of-sequence
    id: what a sim engine draws its tokens from. Read once per model (and version of its
    tokenizer files), not once per instance."""
    stamp = []
    for f in sorted(Path(model_path).iterdir()):
        if "token" in f.name or f.name.startswith(("vocab", "merges")) or f.suffix == ".model":
            with contextlib.suppress(OSError):  # gone meanwhile: not part of the tokenizer
                st = f.stat()
                stamp.append((f.name, st.st_mtime_ns, st.st_size))
    return _read_token_facts(model_path, tuple(stamp))


@functools.lru_cache(maxsize=8)
def _read_token_facts(model_path: str, stamp: tuple[Any, ...]) -> tuple[int, int, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return len(tok), len(tok.all_special_ids) or 1, int(tok.eos_token_id or 0)


def engine_kwargs(cfg: AppConfig, i: int, model_path: Path) -> dict[str, Any]:
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
        import attrs

        from staleflow_trainer.config_sim import engine_config, speed_factors

        # the simulator's engine config, one source for both shells; in real time here
        vocab, specials, eos = _token_facts(str(model_path))
        return {
            "config": attrs.evolve(
                engine_config(cfg),
                vocab_size=vocab,
                num_special_tokens=specials,
                eos_token_id=eos,
                seed=cfg.run.seed + i,
                speed_factor=speed_factors(cfg, max(cfg.rollout.num_instances, i + 1))[i],
            )
        }
    # sglang: attach to a running server (rollout.sglang_url, comma-separated: instance i takes
    # url i mod count). New versions go to it as safetensors through /update_weights_from_disk,
    # checked against the model's tensor shapes first.
    from engine_adapters.sglang import model_weight_shapes

    urls = r.sglang_urls
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


def effective_cpus() -> int:
    """The CPUs this process may really use: its CPU affinity, capped by a cgroup (v2) CPU
    quota when one is set (a container limited to 2 CPUs on a 64-core host has 2)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def check_local_cpus(cfg: AppConfig) -> None:
    """A local run's rollout instances must fit the CPUs the local Ray gets (``ray.num_cpus``,
    or :func:`effective_cpus` when unset): otherwise an instance would wait for a CPU forever.
    A ConfigError naming the keys, before anything starts."""
    if cfg.ray.address or cfg.rollout.backend == "sim":
        return
    r = cfg.rollout
    have = cfg.ray.num_cpus or effective_cpus()
    need = r.num_instances * r.cpus_per_instance
    if need > have:
        source = "ray.num_cpus" if cfg.ray.num_cpus else "the CPUs this machine lets the run use"
        raise ConfigError(
            f"{r.num_instances} rollout instances x rollout.cpus_per_instance="
            f"{r.cpus_per_instance:g} = {need:g} CPUs exceed the {have} of {source}",
            key="rollout.num_instances",
            allowed=f"<= {int(have // max(r.cpus_per_instance, 1e-9))} (or lower "
            "rollout.cpus_per_instance)",
        )


def missing_resources(
    need: Mapping[str, float], count: int, cluster: Mapping[str, float]
) -> list[str]:
    """What ``count`` actors asking ``need`` each cannot get from a cluster whose totals are
    ``cluster`` (Ray resource names), as ``"CPU: 3 needed, 2 in the cluster"`` lines."""
    out = []
    for name, each in need.items():
        want = each * count
        if want > 0 and want > cluster.get(name, 0.0):
            out.append(f"{name}: {want:g} needed, {cluster.get(name, 0.0):g} in the cluster")
    return out


def placement_hint(need: Mapping[str, float], count: int) -> str:
    """Why ``count`` actors asking ``need`` each may not have been placed, for an error
    message: ``"; the cluster lacks ..."`` (:func:`missing_resources`) or ``"; free now: ..."``
    (the cluster's available resources)."""
    import ray

    cluster: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    lacking = missing_resources(need, count, cluster)
    if lacking:
        return f"; the cluster lacks {'; '.join(lacking)}"
    free: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
    return f"; free now: {free}"


class _TokenAuthNotice(logging.Filter):
    """Drops Ray's "Token authentication is enabled" notice: a local Ray enables its token
    authentication by default and says so on every start; the run keeps the token (see
    docs/reliability.md) without the notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def _quiet_token_auth_notice() -> None:
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthNotice) for f in logger.filters):
        logger.addFilter(_TokenAuthNotice())


def _on_loopback(address: str) -> bool:
    """``ray.address`` names a head on this machine's loopback (``127.0.0.1:6379``,
    ``ray://localhost:10001``): the driver must reach it there, not at the node's external IP
    that Ray's cluster mode resolves loopback to."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return is_loopback(host)


_RAY_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": node IP = loopback


def ray_prints_worker_logs() -> bool:
    """Whether this driver's Ray prints the workers' output (``ray.init(log_to_driver=True)``,
    Ray's default; ``init_ray`` turns it off unless ``STALEFLOW_RAY_LOGS`` is set). Read from
    Ray's driver state: its log-printing thread runs."""
    from ray._private import worker

    thread = getattr(worker.global_worker, "logger_thread", None)
    return thread is not None and thread.is_alive()


def init_ray(cfg: AppConfig, progress: StartupProgress | None = None) -> bool:
    """Start a local Ray (or join ``ray.address``); returns True if this call started it.
    A start-up that times out is retried (:func:`ray_init_with_retry`); ``progress`` hears
    the retries."""
    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    on_retry = None if progress is None else (lambda msg: progress.line("ray", msg))
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False  # read at import; ray may be imported

    if ray.is_initialized():
        return False
    if cfg.ray.address:
        if _on_loopback(cfg.ray.address):  # a cluster of raylets on this machine, on loopback
            os.environ[_RAY_SINGLE_MACHINE] = "0"
            ray_constants.ENABLE_RAY_CLUSTER = False
        else:  # its node IP, not loopback (a local run in this process may have set it)
            os.environ.pop(_RAY_SINGLE_MACHINE, None)
            ray_constants.ENABLE_RAY_CLUSTER = not ray_constants.IS_WINDOWS_OR_OSX
        ray_init_with_retry(
            lambda: ray.init(
                address=cfg.ray.address,
                runtime_env={"env_vars": dict(WORKER_ENV)},
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
        _quiet_token_auth_notice()
        ray_init_with_retry(
            lambda: ray.init(
                num_cpus=cfg.ray.num_cpus or effective_cpus(),
                num_gpus=cfg.ray.num_gpus or 0,
                include_dashboard=False,
                object_store_memory=cfg.ray.object_store_mb << 20,
                log_to_driver=bool(os.environ.get("STALEFLOW_RAY_LOGS")),
            ),
            on_retry=on_retry,
        )
    return True


def role_options(cfg: AppConfig, role: str, **kw: Any) -> dict[str, Any]:
    """Ray actor options for ``role`` (control | rollout | trainer | reward): ``kw`` plus a
    sliver of the role's custom resource (``ray.<role>_resource``), if set, so that the actor
    is placed only on nodes that carry it."""
    name = getattr(cfg.ray, f"{role}_resource")
    if name:
        kw["resources"] = {name: 0.001}
    return kw
