"""The SGLang adapter: the engine contract over SGLang's native HTTP API (0.5.x).

Mapping (see the package README for the stand-in used in CI):

* ``generate`` → streaming ``POST /generate`` with ``input_ids`` (prompt + resumed tokens),
  ``rid`` = trajectory id, ``return_logprob``, ``ignore_eos`` (the contract adds no implicit
  EOS) and ``stop_token_ids``. Each chunk's ``meta_info.weight_version`` tags its new tokens,
  which gives per-token versions.
* ``interrupt`` → ``POST /abort_request`` (``rid`` or ``abort_all``); the open ``/generate``
  stream ends with finish type ``abort`` and the partial output, which both ``interrupt`` and the
  pending ``generate`` return.
* ``load_weights`` → write the tensors as safetensors under ``weights_dir``, then
  ``/pause_generation`` (``in_place``), ``/update_weights_from_disk`` with ``weight_version``
  and ``flush_cache``, and ``/continue_generation`` — so no token is served by half-loaded
  weights and chunk versions are exact.
* ``snapshot`` → ``GET /metrics`` (``--enable-metrics``) for running / queued / token usage /
  throughput, plus the adapter's own per-trajectory token counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tempfile
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import structlog

from engine_adapters._contract import (
    EngineAdapter,
    EngineSnapshot,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    RunningTrajectory,
)
from engine_adapters.errors import (
    EngineDead,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    InvalidWeights,
    PromptTooLong,
    UnknownTrajectory,
)
from engine_adapters.sglang import _safetensors
from engine_adapters.sglang._launcher import SglangLaunchConfig, SglangProcess, wait_healthy

log = structlog.get_logger(__name__)

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.INTERRUPTED,
}
_METRIC = re.compile(r"^(sglang:[a-z_]+)(?:\{[^}]*\})?\s+([-+0-9.eEinfa]+)\s*$")


@attrs.define(eq=False)
class _Inflight:
    request: GenerateRequest
    done: asyncio.Future[GenerateResult]
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    versions: list[int] = attrs.Factory(list)


class SglangAdapter(EngineAdapter):
    """One SGLang server (launched by ``launch`` or attached at ``base_url``)."""

    backend = "sglang"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        launch: SglangLaunchConfig | Mapping[str, Any] | None = None,
        instance_id: str = "sglang-0",
        weights_dir: str | None = None,
        weight_shapes: Mapping[str, Sequence[int]] | None = None,
        request_timeout_s: float = 600.0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if launch is not None and not isinstance(launch, SglangLaunchConfig):
            launch = SglangLaunchConfig(**launch)
        if (base_url is None) == (launch is None):
            raise InvalidRequest(
                "give exactly one of base_url (attach) or launch", field="base_url"
            )
        self._launch = launch
        self._base_url = base_url if base_url is not None else launch.base_url  # type: ignore[union-attr]
        self._instance_id = instance_id
        self._weights_dir = Path(weights_dir) if weights_dir else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._weight_shapes = (
            {k: tuple(int(d) for d in v) for k, v in weight_shapes.items()}
            if weight_shapes
            else None
        )
        self._request_timeout_s = request_timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._process: SglangProcess | None = None
        self._inflight: dict[str, _Inflight] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # ids whose generate() resolved
        self._version = 0
        self._context_length: int | None = None
        self._seq = 0
        self._closed = False
        self._load_lock = asyncio.Lock()
        self._log = log.bind(instance=instance_id, backend="sglang", url=self._base_url)

    # ------------------------------------------------------------------ lifecycle
    @property
    def instance_id(self) -> str:
        return self._instance_id

    @property
    def version(self) -> int:
        return self._version

    @property
    def base_url(self) -> str:
        return self._base_url

    async def start(self) -> None:
        if self._closed:
            raise EngineUnavailable(f"sglang instance {self._instance_id!r} is closed")
        if self._client is not None:
            return
        if self._launch is not None:
            self._process = SglangProcess(self._launch)
            await asyncio.to_thread(self._process.start)
        else:
            await asyncio.to_thread(wait_healthy, self._base_url, self._startup_timeout_s)
        self._client = httpx.AsyncClient(base_url=self._base_url, timeout=self._request_timeout_s)
        info = await self._get("/get_server_info")
        self._context_length = int(info.get("context_length") or 0) or None
        self._version = _parse_version(info.get("weight_version"), default=0)
        self._log.info("sglang_attached", server_version=info.get("version"), version=self._version)

    async def close(self) -> None:
        if self._closed:
            return
        if self._client is not None and self._inflight:
            with contextlib.suppress(EngineError, httpx.HTTPError):
                await self.interrupt(None)
        self._closed = True
        if self._client is not None:
            await self._client.aclose()
        if self._process is not None:
            await asyncio.to_thread(self._process.stop)
        if self._tmp is not None:
            self._tmp.cleanup()
        self._log.info("sglang_closed")

    # ------------------------------------------------------------------ verbs
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        client = self._require()
        tid = request.trajectory_id
        if tid in self._inflight:
            raise InvalidRequest(f"trajectory {tid!r} is already generating", field="trajectory_id")
        prior = len(request.generated_token_ids)
        input_ids = [*request.prompt_token_ids, *request.generated_token_ids]
        if self._context_length is not None and len(input_ids) >= self._context_length:
            raise PromptTooLong(
                f"trajectory {tid!r}: {len(input_ids)} prompt + resumed tokens leave no room in "
                f"the server's context_length={self._context_length}",
                field="prompt_token_ids",
            )
        s = request.sampling
        body: dict[str, Any] = {
            "rid": tid,
            "input_ids": input_ids,
            "stream": True,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": s.max_new_tokens - prior,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "stop_token_ids": list(s.stop_token_ids),
                "ignore_eos": True,
                **({"sampling_seed": s.seed} if s.seed is not None else {}),
            },
        }
        state = _Inflight(request=request, done=asyncio.get_running_loop().create_future())
        self._inflight[tid] = state
        self._recent.pop(tid, None)
        try:
            result = await self._stream(client, body, state)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._post("/abort_request", {"rid": tid}))
            raise
        finally:
            self._inflight.pop(tid, None)
            self._recent[tid] = None
            if len(self._recent) > 100_000:
                self._recent.popitem(last=False)
        if not state.done.done():
            state.done.set_result(result)
        return result

    async def interrupt(self, trajectory_ids: Sequence[str] | None = None) -> list[GenerateResult]:
        self._require()
        if trajectory_ids is None:
            targets = list(self._inflight)
        else:
            targets = list(dict.fromkeys(trajectory_ids))
            unknown = [t for t in targets if t not in self._inflight and t not in self._recent]
            if unknown:
                raise UnknownTrajectory(unknown)
            # Ids that finished a moment ago already resolved their generate(); skip them.
            targets = [t for t in targets if t in self._inflight]
        # Take the futures first: a stream may finish (and leave _inflight) while we post.
        futures = [self._inflight[t].done for t in targets]
        if trajectory_ids is None:
            if targets:
                await self._post("/abort_request", {"abort_all": True})
        else:
            for t in targets:
                await self._post("/abort_request", {"rid": t})
        async with asyncio.timeout(self._request_timeout_s):
            results = await asyncio.gather(*futures)
        self._log.debug("sglang_interrupted", count=len(results))
        return list(results)

    async def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> int:
        self._require()
        if version < self._version:
            raise InvalidRequest(
                f"version {version} is older than the served version {self._version}",
                field="version",
            )
        self._check_weights(named_tensors)
        async with self._load_lock:
            target = self._weights_root() / f"v{version}"
            target.mkdir(parents=True, exist_ok=True)
            nbytes = await asyncio.to_thread(
                _safetensors.save_file, named_tensors, target / "model.safetensors"
            )
            await self._post("/pause_generation", {"mode": "in_place"})
            try:
                resp = await self._require().post(
                    "/update_weights_from_disk",
                    json={
                        "model_path": str(target),
                        "weight_version": str(version),
                        "flush_cache": True,
                        "abort_all_requests": False,
                    },
                )
            finally:
                await self._post("/continue_generation", {})
            data = _json(resp)
            if resp.status_code != 200 or not data.get("success", False):
                raise InvalidWeights(
                    f"sglang rejected weights v{version}: {data.get('message', resp.text)}",
                    field="named_tensors",
                )
            self._version = version
        self._log.info("sglang_loaded_weights", version=version, nbytes=nbytes)
        return version

    async def snapshot(self) -> EngineSnapshot:
        client = self._require()
        resp = await client.get("/metrics")
        if resp.status_code != 200:
            raise EngineUnavailable(
                f"GET /metrics answered {resp.status_code}; start SGLang with --enable-metrics"
            )
        metrics = parse_metrics(resp.text)
        capacity = int(metrics.get("sglang:max_total_num_tokens", 0))
        running = tuple(
            RunningTrajectory(
                trajectory_id=tid,
                prompt_tokens=len(st.request.prompt_token_ids),
                generated_tokens=len(st.request.generated_token_ids) + len(st.token_ids),
            )
            for tid, st in self._inflight.items()
            if st.token_ids or st.request.generated_token_ids
        )
        self._seq += 1
        return EngineSnapshot(
            instance_id=self._instance_id,
            seq=self._seq,
            time_s=time.monotonic(),
            version=self._version,
            running=running,
            waiting=int(metrics.get("sglang:num_queue_reqs", 0)),
            kv_used_tokens=round(metrics.get("sglang:token_usage", 0.0) * capacity),
            kv_capacity_tokens=capacity,
            throughput_tokens_per_s=float(metrics.get("sglang:gen_throughput", 0.0)),
        )

    # ------------------------------------------------------------------ internals
    async def _stream(
        self, client: httpx.AsyncClient, body: dict[str, Any], state: _Inflight
    ) -> GenerateResult:
        req = state.request
        prior = len(req.generated_token_ids)
        finish: dict[str, Any] | None = None
        async with client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                message = _json(resp).get("error", {}).get("message", resp.text)
                if resp.status_code >= 500:  # the server failed, not the request
                    raise EngineUnavailable(
                        f"sglang server failed {req.trajectory_id!r}: HTTP {resp.status_code}: "
                        f"{str(message)[:200]}"
                    )
                self._raise_server_error(message, req)
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    self._raise_server_error(chunk["error"].get("message", str(chunk)), req)
                meta = chunk["meta_info"]
                triples = meta.get("output_token_logprobs") or []
                version = _parse_version(meta.get("weight_version"), default=self._version)
                for lp, tok, *_ in triples[len(state.token_ids) :]:
                    state.token_ids.append(int(tok))
                    state.logprobs.append(float(lp))
                    state.versions.append(version)
                if meta.get("finish_reason"):
                    finish = meta["finish_reason"]
        if finish is None:
            raise EngineUnavailable(f"sglang stream for {req.trajectory_id!r} ended without finish")
        reason = _FINISH.get(finish.get("type", ""), FinishReason.INTERRUPTED)
        del prior
        return GenerateResult(
            trajectory_id=req.trajectory_id,
            token_ids=req.generated_token_ids + tuple(state.token_ids),
            logprobs=req.generated_logprobs + tuple(state.logprobs),
            versions=req.generated_versions + tuple(state.versions),
            finish_reason=reason,
        )

    def _raise_server_error(self, message: str, req: GenerateRequest) -> None:
        if "context length" in message or "longer than" in message:
            raise PromptTooLong(f"{req.trajectory_id!r}: {message}", field="prompt_token_ids")
        raise InvalidRequest(f"sglang rejected {req.trajectory_id!r}: {message}", field="request")

    def _check_weights(self, named_tensors: Mapping[str, Any]) -> None:
        if not named_tensors:
            raise InvalidWeights("load_weights got no tensors", field="named_tensors")
        if self._weight_shapes is None:
            return
        shapes = {
            k: tuple(int(d) for d in getattr(v, "shape", v)) for k, v in named_tensors.items()
        }
        spec = self._weight_shapes
        missing = sorted(set(spec) - set(shapes))
        extra = sorted(set(shapes) - set(spec))
        misshaped = {n: (shapes[n], spec[n]) for n in spec if n in shapes and shapes[n] != spec[n]}
        if missing or extra or misshaped:
            raise InvalidWeights(
                f"weights do not match the model: missing={missing}, extra={extra}, "
                f"mis-shaped (got, expected)={misshaped}",
                field="named_tensors",
            )

    def _weights_root(self) -> Path:
        if self._weights_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="staleflow-sglang-weights-")
            self._weights_dir = Path(self._tmp.name)
        return self._weights_dir

    async def check_health(self) -> None:
        """A launched server that exited is dead; an attached one (``base_url``) is never
        judged here: its process is not ours to see, and its calls fail if it is gone."""
        proc = None if self._process is None else self._process.proc
        if not self._closed and proc is not None and proc.poll() is not None:
            raise EngineDead(
                f"sglang server of {self._instance_id!r} exited with code {proc.returncode}"
            )

    def _require(self) -> httpx.AsyncClient:
        if self._closed:
            raise EngineUnavailable(f"sglang instance {self._instance_id!r} is closed")
        if self._client is None:
            raise EngineUnavailable(f"sglang instance {self._instance_id!r} not started")
        return self._client

    async def _get(self, path: str) -> dict[str, Any]:
        resp = await self._require().get(path)
        if resp.status_code != 200:
            raise EngineUnavailable(f"GET {path} answered {resp.status_code}: {resp.text[:200]}")
        return _json(resp)

    async def _post(self, path: str, body: dict[str, Any]) -> None:
        resp = await self._require().post(path, json=body)
        if resp.status_code != 200:
            raise EngineUnavailable(f"POST {path} answered {resp.status_code}: {resp.text[:200]}")


def parse_metrics(text: str) -> dict[str, float]:
    """``sglang:*`` gauges from a Prometheus text page (summed over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _parse_version(value: Any, *, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _json(resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
