"""Configuration of one vLLM rollout instance.

Defaults depend on the device only through ``torch.cuda.is_available()`` (checked when the
config is built): on CPU the engine runs fp32 and eager with an explicit KV-cache budget; on a
GPU it keeps vLLM's own defaults (``dtype="auto"``, CUDA graphs, memory fraction).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from engine_adapters.errors import InvalidRequest

LoadMode = Literal["keep", "abort"]
# vLLM's own default token budget of a step, raised to max_model_len on CPU (see engine_args)
CPU_MIN_BATCHED_TOKENS = 2048
LOAD_MODES: tuple[str, ...] = ("keep", "abort")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch comes with the vllm extra
        return False
    return bool(torch.cuda.is_available())


def _positive(name: str) -> Callable[[Any, Any, int | float | None], None]:
    def check(_inst: Any, _attr: Any, value: int | float | None) -> None:
        if value is not None and value <= 0:
            raise InvalidRequest(f"{name} must be > 0, got {value!r}", field=name)

    return check


@attrs.frozen(kw_only=True)
class VllmConfig:
    """Everything needed to start one ``AsyncLLM`` for a rollout instance.

    ``engine_kwargs`` are passed verbatim to ``vllm.AsyncEngineArgs`` and override the fields
    derived here (use it for ``tensor_parallel_size``, ``num_gpu_blocks_override``, …).
    """

    model_path: Path = attrs.field(converter=Path)
    instance_id: str = "vllm-0"
    max_model_len: int = attrs.field(default=1024, validator=_positive("max_model_len"))
    max_num_seqs: int = attrs.field(default=256, validator=_positive("max_num_seqs"))
    seed: int = 0
    initial_version: int = 0
    # GPU only: the fraction of device memory vLLM may take (weights + KV cache).
    gpu_memory_utilization: float = 0.9
    # CPU only: KV-cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; integer GiB).
    cpu_kv_cache_gib: int = attrs.field(default=1, validator=_positive("cpu_kv_cache_gib"))
    dtype: str | None = None  # None: "float32" on CPU, "auto" on GPU
    enforce_eager: bool | None = None  # None: True on CPU (compile buys nothing there)
    # What happens to in-flight trajectories during load_weights: "keep" freezes them and lets
    # them continue on the new weights (their later tokens carry the new version); "abort"
    # interrupts them (their generate() calls resolve as interrupted with partial output).
    load_mode: str = "keep"
    throughput_window_s: float = attrs.field(
        default=5.0, validator=_positive("throughput_window_s")
    )
    engine_kwargs: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self) -> None:
        if not self.instance_id:
            raise InvalidRequest("instance_id must be a non-empty string", field="instance_id")
        if self.load_mode not in LOAD_MODES:
            raise InvalidRequest(
                f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r}", field="load_mode"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequest(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}",
                field="gpu_memory_utilization",
            )
        if self.initial_version < 0:
            raise InvalidRequest(
                f"initial_version must be >= 0, got {self.initial_version!r}",
                field="initial_version",
            )

    def engine_args(self, *, on_gpu: bool | None = None) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``."""
        gpu = _cuda_available() if on_gpu is None else on_gpu
        args: dict[str, Any] = {
            "model": str(self.model_path),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "seed": self.seed,
            "dtype": self.dtype or ("auto" if gpu else "float32"),
            "enforce_eager": (not gpu) if self.enforce_eager is None else self.enforce_eager,
            "distributed_executor_backend": "uni",
            "worker_extension_cls": "engine_adapters.vllm._worker.WeightLoadExtension",
            "disable_log_stats": True,  # our own stat logger still receives SchedulerStats
        }
        if gpu:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            # vLLM-CPU's model runner rewinds a seeded request's random generator after a
            # prefill chunk that is not the last, which a CPU generator cannot do: the
            # EngineCore dies ("CPU Generator does not use offset"). Every rollout request is
            # seeded, so on CPU prompts (and resumed prefixes) are prefilled whole.
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(CPU_MIN_BATCHED_TOKENS, self.max_model_len)
        args.update(self.engine_kwargs)
        if not gpu:
            self._check_cpu_prefill(args)
        return args

    def _check_cpu_prefill(self, args: Mapping[str, Any]) -> None:
        if args["enable_chunked_prefill"] is not False:  # None lets vLLM turn it on
            raise InvalidRequest(
                "engine_kwargs.enable_chunked_prefill must be False on CPU: vLLM-CPU stops its "
                "engine when a seeded request (every rollout request is) is prefilled in chunks",
                field="engine_kwargs.enable_chunked_prefill",
            )
        budget = args["max_num_batched_tokens"]
        if not isinstance(budget, int) or budget < self.max_model_len:
            raise InvalidRequest(
                f"engine_kwargs.max_num_batched_tokens must be >= max_model_len "
                f"({self.max_model_len}) on CPU, where prompts are prefilled whole; got {budget}",
                field="engine_kwargs.max_num_batched_tokens",
            )

    def environment(self, *, on_gpu: bool | None = None) -> dict[str, str]:
        """Environment variables the engine process must see (inherited at spawn).

        On CPU, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the model worker inside the
        EngineCore process: otherwise vLLM's CPU platform turns the ``uni`` executor into
        ``mp`` (one more process, ~3x slower start, and tensors cannot cross its RPC).
        """
        gpu = _cuda_available() if on_gpu is None else on_gpu
        env = {} if gpu else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        return env | {"VLLM_CPU_KVCACHE_SPACE": str(self.cpu_kv_cache_gib)}


# Set only if the caller has not chosen otherwise.
DEFAULT_ENVIRONMENT = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
