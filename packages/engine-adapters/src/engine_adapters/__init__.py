"""One async contract for rollout engines (sim, vLLM, SGLang), loaded lazily.

Importing this package imports no engine: backends load on demand through
:func:`create_engine` / :func:`load_backend`.
"""

from engine_adapters._contract import (
    EngineAdapter,
    EngineSnapshot,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ProfilePoint,
    RunningTrajectory,
    SamplingParams,
    write_profile_jsonl,
)
from engine_adapters._delta import (
    SnapshotDecoder,
    SnapshotEncoder,
    id_prefix,
    pack_ids,
    unpack_ids,
)
from engine_adapters._registry import BACKENDS, create_engine, load_backend
from engine_adapters.errors import (
    BackendNotInstalled,
    EngineDead,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    InvalidWeights,
    PromptTooLong,
    UnknownTrajectory,
)

__version__ = "0.3.0"

__all__ = [
    "BACKENDS",
    "BackendNotInstalled",
    "EngineAdapter",
    "EngineDead",
    "EngineError",
    "EngineSnapshot",
    "EngineUnavailable",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "InvalidRequest",
    "InvalidWeights",
    "ProfilePoint",
    "PromptTooLong",
    "RunningTrajectory",
    "SamplingParams",
    "SnapshotDecoder",
    "SnapshotEncoder",
    "UnknownTrajectory",
    "create_engine",
    "id_prefix",
    "load_backend",
    "pack_ids",
    "unpack_ids",
    "write_profile_jsonl",
]
