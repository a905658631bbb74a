"""The engine contract: what every rollout backend (sim, vLLM, SGLang) must do.

Theory of operation
-------------------
One adapter drives one rollout *instance*. The coordinator talks to it with four verbs:

* ``generate(request)`` — token ids in (a fresh prompt, or prompt + already generated tokens
  when resuming a partial trajectory), a :class:`GenerateResult` out. The coroutine returns when
  the trajectory stops for any reason: ``stop`` / ``length`` (finished) or ``interrupted``
  (someone called :meth:`EngineAdapter.interrupt`, or a weight load aborted it).
* ``interrupt(ids | None)`` — stop those trajectories (``None`` = all, including ones still
  waiting inside the engine) and return their partial outputs. Each interrupted trajectory's
  ``generate`` coroutine also resolves with the same partial result, so callers may use either
  path; the pair never yields the same tokens twice. An id the engine never held raises
  :class:`~engine_adapters.errors.UnknownTrajectory` and stops nothing; an id whose
  ``generate`` already resolved (it finished a moment before the interrupt) is skipped: it is
  absent from the returned list, its result came through ``generate``.

Generation stops only at the request's ``stop_token_ids`` (the stop token is included in the
output) or at ``max_new_tokens`` / the model context; adapters never add the model's EOS
implicitly — callers put EOS in ``stop_token_ids``. Results always cover the whole trajectory
so far, resumed prefix included, with one logprob and one model version per token.
* ``load_weights(version, named_tensors)`` — replace the weights in place; the prefix cache is
  reset (or salted by version) and no request is ever served by half-loaded weights.
* ``snapshot()`` — the five fields the coordinator needs (version, running trajectories with
  token counts, waiting count, KV usage, generation throughput), and the engine's decode-step
  counter, so that a poll can send running trajectories as deltas (:class:`SnapshotEncoder`).
* ``check_health()`` — raises :class:`~engine_adapters.errors.EngineDead` once the engine's
  process has died (its calls may otherwise wait forever: a weight load in flight when vLLM's
  EngineCore dies never returns); the host then treats the instance as lost.

Records are frozen attrs classes; every field is validated at construction so that bad input
fails at the edge with the field named.
"""

from __future__ import annotations

import abc
import enum
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import attrs

from engine_adapters.errors import InvalidRequest


class FinishReason(enum.StrEnum):
    """Why a generation stopped. A trajectory *finishes* with ``stop`` or ``length``; an
    ``interrupted`` one returns its partial output and is resumed later."""

    STOP = "stop"  # a stop token / EOS was produced
    LENGTH = "length"  # max_new_tokens (or the model context) reached
    INTERRUPTED = "interrupted"  # interrupted / aborted; partial output returned


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_tuple_of_ints(value: object) -> TypeGuard[tuple[int, ...]]:
    # The fast path (C speed): an existing tuple of plain ints is kept as is.
    return type(value) is tuple and set(map(type, value)) <= {int}


def _tuple_of_ints(value: Sequence[int]) -> tuple[int, ...]:
    if _is_tuple_of_ints(value):
        return value
    return tuple(map(int, value))


def _tuple_of_floats(value: Sequence[float]) -> tuple[float, ...]:
    if type(value) is tuple and set(map(type, value)) <= {float}:
        return value
    return tuple(map(float, value))


def _stop_token_ids(value: Iterable[int]) -> tuple[int, ...]:
    """Token ids as a tuple of ints; anything else (a bool, a float, a string) is refused,
    never converted."""
    if _is_tuple_of_ints(value):
        return value
    try:
        items = tuple(value)
    except TypeError:
        raise InvalidRequest(
            f"stop_token_ids must be a sequence of ints, got {type(value).__name__}",
            field="stop_token_ids",
        ) from None
    for v in items:
        if not _is_int(v):
            raise InvalidRequest(
                f"stop_token_ids must hold ints (not bools), got {v!r:.40}",
                field="stop_token_ids",
            )
    return items


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one trajectory is sampled: the single record every hop uses (the trajectory server
    stores it with the payload, the engine request carries the same object).

    ``temperature``: a finite number >= 0 (0 = greedy); ``top_p``: a number in (0, 1];
    ``max_new_tokens``: an int >= 1, the whole response (resumed prefix included);
    ``stop_token_ids``: ints, the stop token is included in the output; ``seed``: None or an
    int. Bools are refused where a number is meant. A bad value raises
    :class:`~engine_adapters.errors.InvalidRequest` naming the field and what it allows."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_token_ids)
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not 0.0 <= t < math.inf:
            raise InvalidRequest(
                f"temperature must be a finite number >= 0 (int or float, not bool), got {t!r:.40}",
                field="temperature",
            )
        p = self.top_p
        if not _is_number(p) or not 0.0 < p <= 1.0:
            raise InvalidRequest(
                f"top_p must be a number in (0, 1] (int or float, not bool), got {p!r:.40}",
                field="top_p",
            )
        m = self.max_new_tokens
        if not _is_int(m) or m < 1:
            raise InvalidRequest(
                f"max_new_tokens must be an int >= 1 (not bool), got {m!r:.40}",
                field="max_new_tokens",
            )
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequest(
                f"seed must be None or an int (not bool), got {self.seed!r:.40}", field="seed"
            )


@attrs.frozen(kw_only=True)
class GenerateRequest:
    """One trajectory (segment) to generate.

    ``generated_*`` carry what earlier segments produced when resuming a partial trajectory;
    the engine continues after them (prefix = prompt + generated) and the result it returns
    covers the *whole* trajectory so far (earlier tokens first).
    ``max_new_tokens`` in ``sampling`` counts the whole response, earlier segments included.
    """

    trajectory_id: str
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    generated_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_ints)
    generated_logprobs: tuple[float, ...] = attrs.field(default=(), converter=_tuple_of_floats)
    generated_versions: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_ints)
    # Opaque workload hint used only by the sim backend: the response length this trajectory
    # would reach if never stopped. Real engines ignore it.
    target_length: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.trajectory_id:
            raise InvalidRequest("trajectory_id must be a non-empty string", field="trajectory_id")
        if not self.prompt_token_ids:
            raise InvalidRequest(
                f"prompt_token_ids of {self.trajectory_id!r} is empty; a prompt needs >= 1 token",
                field="prompt_token_ids",
            )
        n = len(self.generated_token_ids)
        if len(self.generated_logprobs) != n or len(self.generated_versions) != n:
            raise InvalidRequest(
                "generated_token_ids, generated_logprobs and generated_versions must have equal "
                f"lengths, got {n}, {len(self.generated_logprobs)}, {len(self.generated_versions)}",
                field="generated_logprobs",
            )
        if n >= self.sampling.max_new_tokens:
            raise InvalidRequest(
                f"trajectory {self.trajectory_id!r} already has {n} generated tokens, "
                f">= max_new_tokens={self.sampling.max_new_tokens}",
                field="generated_token_ids",
            )


@attrs.frozen(kw_only=True)
class GenerateResult:
    """The whole trajectory so far (resumed prefix included)."""

    trajectory_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    logprobs: tuple[float, ...] = attrs.field(converter=_tuple_of_floats)
    versions: tuple[int, ...] = attrs.field(converter=_tuple_of_ints)
    finish_reason: FinishReason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not FinishReason.INTERRUPTED


@attrs.frozen(kw_only=True)
class RunningTrajectory:
    trajectory_id: str
    prompt_tokens: int
    generated_tokens: int


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    """The five fields the coordinator reads (version, running, waiting, KV usage, throughput;
    docs/design.md, "Rollout coordinator"), plus a monotone sequence number."""

    instance_id: str
    seq: int  # increases with every snapshot an adapter takes; lets consumers drop stale ones
    time_s: float  # the adapter's clock when taken (virtual for sim)
    version: int
    running: tuple[RunningTrajectory, ...]
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    throughput_tokens_per_s: float
    # Decode steps the engine has run (0: the engine keeps no count). A running trajectory
    # that decodes without pause gains one token per step; snapshot deltas rely on it
    # (engine_adapters.SnapshotEncoder).
    decode_steps: int = 0

    @property
    def kv_usage(self) -> float:
        if self.kv_capacity_tokens <= 0:
            return 0.0
        return self.kv_used_tokens / self.kv_capacity_tokens


@attrs.frozen(kw_only=True)
class ProfilePoint:
    """One profiling measurement: per-decode-step latency at (running, kv_tokens)."""

    running: int
    kv_tokens: int
    step_latency_s: float
    backend: str

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class EngineAdapter(abc.ABC):
    """Async adapter for one rollout instance. See the module docstring for the semantics."""

    backend: str = "abstract"

    @property
    @abc.abstractmethod
    def instance_id(self) -> str: ...

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The model version currently served."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the engine up (idempotent)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Shut the engine down; in-flight generate calls resolve as interrupted."""

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    @abc.abstractmethod
    async def interrupt(self, trajectory_ids: Sequence[str] | None = None) -> list[GenerateResult]:
        """Stop the given trajectories (None = all) and return their partial outputs.

        Unknown ids raise :class:`engine_adapters.errors.UnknownTrajectory` and stop nothing.
        """

    @abc.abstractmethod
    async def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> int:
        """Load ``version`` in place; returns the version now served.

        Tensors are validated (names, shapes) before anything is touched; on error the engine
        keeps serving what it had.
        """

    @abc.abstractmethod
    async def snapshot(self) -> EngineSnapshot: ...

    async def check_health(self) -> None:
        """Raise :class:`engine_adapters.errors.EngineDead` once the engine's process has died
        or it can never serve again (vLLM: a weight load that failed after validation left it
        paused); return otherwise (also before ``start`` and after ``close``). Cheap enough to call
        every second. The default finds nothing: an engine without a process of its own dies
        with its host."""
        return None

    async def profile(
        self,
        points: Sequence[tuple[int, int]],
        *,
        steps: int = 8,
        sampling: SamplingParams | None = None,
    ) -> list[ProfilePoint]:
        """Measure per-step decode latency at (running trajectories, KV tokens) points.

        ``sampling``: the rollout's sampling settings; the measured requests decode with them
        (stop tokens left out, so every request decodes ``steps`` tokens) and so time the
        decode steps the rollout runs. Default ``SamplingParams()``."""
        raise NotImplementedError(f"{type(self).__name__} does not support profiling")


def write_profile_jsonl(points: Sequence[ProfilePoint], path: str | os.PathLike[str]) -> int:
    """Append ``points`` to a JSONL file (one object per line); returns the count written.

    This is the input format of the coordinator's cost-model fit.
    """
    with open(path, "a", encoding="utf-8") as f:
        for p in points:
            f.write(json.dumps(p.to_json(), sort_keys=True) + "\n")
    return len(points)
