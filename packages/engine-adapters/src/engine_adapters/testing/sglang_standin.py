"""A STAND-IN for SGLang's HTTP server, for tests on machines where SGLang cannot run.

This is **not SGLang**. SGLang needs CUDA kernels (its CPU path needs ``sgl_kernel`` ops built from source), so CI tests the
SGLang adapter against this in-repo server, which implements the documented semantics of the
endpoints the adapter uses, following the SGLang **0.5.x** native HTTP API
(``python/sglang/srt/entrypoints/http_server.py`` / ``managers/io_struct.py``):

* ``POST /generate`` — ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``,
  ``top_p``, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``), ``return_logprob``,
  ``rid``, ``stream``. Streaming sends ``data: {json}`` chunks with cumulative ``output_ids``
  and ``meta_info`` (``id``, ``finish_reason`` = null / ``{"type": "stop", "matched": id}`` /
  ``{"type": "length", "length": n}`` / ``{"type": "abort", "message": ...}``,
  ``prompt_tokens``, ``completion_tokens``, ``weight_version``, ``output_token_logprobs`` as
  ``[logprob, token_id, null]`` triples), then ``data: [DONE]``. Errors (e.g. a prompt longer
  than the context) come as a ``{"error": {"message": ...}}`` chunk, as in SGLang.
* ``POST /abort_request`` — ``{"rid": ...}`` or ``{"abort_all": true}``; answers 200 at once;
  the aborted request's ``/generate`` then ends with its partial output and finish type
  ``abort`` (waiting-queue requests included, as SGLang does since PR #11673). Unknown rids are
  ignored, as in SGLang.
* ``POST /pause_generation`` ``{"mode": "abort" | "in_place" | "retract"}`` and
  ``POST /continue_generation``. Deviation: ``retract`` behaves like ``in_place`` (KV is not
  dropped and recomputed).
* ``POST /update_weights_from_disk`` — ``model_path`` (a directory of ``*.safetensors``),
  ``weight_version``, ``load_format``, ``flush_cache``, ``abort_all_requests``; answers
  ``{"success", "message", "num_paused_requests"}`` (400 with ``success: false`` when names or
  shapes do not match the model — the served weights are untouched).
* ``GET /get_weight_version``, ``/get_model_info``, ``/get_server_info`` (alias
  ``/server_info``), ``/health``, ``/health_generate`` and ``GET /metrics`` with
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
  ``sglang:gen_throughput``, ``sglang:max_total_num_tokens``.

Token timing, KV budget, batching and weight-load time come from the sim engine
(:class:`engine_adapters.sim.SimAdapter` on a real-time clock); tokens and logprobs are
synthetic. Output chunks are split at weight-version changes, so every chunk's
``weight_version`` is exact for its tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from engine_adapters._contract import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from engine_adapters.errors import EngineError, InvalidRequest
from engine_adapters.sglang._safetensors import read_header
from engine_adapters.sim import SimAdapter, SimConfig

log = structlog.get_logger(__name__)

SGLANG_API_VERSION = "0.5.x"
STANDIN_VERSION = f"{SGLANG_API_VERSION}-staleflow-standin"


def _finish(result: GenerateResult, max_new: int) -> dict[str, Any] | None:
    if result.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": result.token_ids[-1]}
    if result.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": max_new}
    return {"type": "abort", "message": "Abort request"}


class _StandInState:
    def __init__(self, config: SimConfig, speed: float, stream_interval_s: float) -> None:
        self.config = config
        self.sim = SimAdapter(config, instance_id="sglang-standin", speed=speed)
        self.stream_interval_s = stream_interval_s
        self.rids: dict[str, asyncio.Task[GenerateResult]] = {}
        self.failing: tuple[str, int] | None = None  # every /generate fails: (message, status)


def build_app(  # noqa: C901 - the app's routes are nested handlers over one state
    config: SimConfig, *, speed: float = 1.0, stream_interval_s: float = 0.005
) -> FastAPI:
    """The FastAPI app of the stand-in (served by :class:`SglangStandIn`)."""
    state = _StandInState(config, speed, stream_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await state.sim.start()
        yield
        await state.sim.close()

    app = FastAPI(lifespan=lifespan)
    app.state.standin = state

    def weight_version() -> str:
        return str(state.sim.version)

    def chunk(
        rid: str, prompt_len: int, res: GenerateResult, prior: int, fin: Any, ver: str
    ) -> bytes:
        out = res.token_ids[prior:]
        meta = {
            "id": rid,
            "finish_reason": fin,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": ver,
            "output_token_logprobs": [
                [lp, tok, None] for lp, tok in zip(res.logprobs[prior:], out, strict=True)
            ],
        }
        return (
            b"data: "
            + json.dumps({"text": "", "output_ids": list(out), "meta_info": meta}).encode()
            + b"\n\n"
        )

    def split_by_version(res: GenerateResult, sent: int) -> list[tuple[int, str]]:
        """Cumulative cut points (end index, version) for tokens after ``sent``."""
        cuts = []
        for i in range(sent, len(res.token_ids)):
            if i + 1 == len(res.token_ids) or res.versions[i + 1] != res.versions[i]:
                cuts.append((i + 1, str(res.versions[i])))
        return cuts

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        rid = body.get("rid") or f"standin-{id(body)}"
        input_ids = body.get("input_ids")
        sp = body.get("sampling_params") or {}
        stream = bool(body.get("stream", False))

        def error(message: str) -> Response:
            if stream:

                async def err() -> AsyncIterator[bytes]:
                    yield b"data: " + json.dumps({"error": {"message": message}}).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(err(), media_type="text/event-stream")
            return JSONResponse({"error": {"message": message}}, status_code=400)

        if state.failing is not None:  # as a gateway in front of a failing server answers
            message, status = state.failing
            return JSONResponse({"error": {"message": message}}, status_code=status)
        if not isinstance(input_ids, list) or not input_ids:
            return error("input_ids must be a non-empty list of token ids")
        if len(input_ids) >= config.max_model_len:
            return error(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({config.max_model_len} tokens)."
            )
        if rid in state.rids:
            return error(f"Duplicate request id {rid}")
        if not sp.get("ignore_eos", False):
            stop_ids = (*sp.get("stop_token_ids", ()), config.eos_token_id)
        else:
            stop_ids = tuple(sp.get("stop_token_ids", ()))
        max_new = int(sp.get("max_new_tokens", 128))
        try:
            req = GenerateRequest(
                trajectory_id=rid,
                prompt_token_ids=input_ids,
                sampling=SamplingParams(
                    temperature=float(sp.get("temperature", 1.0)),
                    top_p=float(sp.get("top_p", 1.0)),
                    max_new_tokens=max_new,
                    stop_token_ids=stop_ids,
                    seed=sp.get("sampling_seed"),
                ),
            )
            task = asyncio.ensure_future(state.sim.generate(req))
            await asyncio.sleep(0)
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        except (EngineError, InvalidRequest) as exc:
            return error(str(exc))
        state.rids[rid] = task
        plen = len(input_ids)

        async def body_stream() -> AsyncIterator[bytes]:
            sent = 0
            try:
                while not task.done():
                    with contextlib.suppress(EngineError):
                        res = await state.sim.progress(rid)
                        for end, ver in split_by_version(res, sent):
                            yield chunk(
                                rid,
                                plen,
                                GenerateResult(
                                    trajectory_id=rid,
                                    token_ids=res.token_ids[:end],
                                    logprobs=res.logprobs[:end],
                                    versions=res.versions[:end],
                                    finish_reason=FinishReason.INTERRUPTED,
                                ),
                                0,
                                None,
                                ver,
                            )
                            sent = end
                    await asyncio.wait([task], timeout=state.stream_interval_s)
                res = task.result()
                cuts = split_by_version(res, sent) or [(len(res.token_ids), weight_version())]
                for i, (end, ver) in enumerate(cuts):
                    last = i == len(cuts) - 1
                    part = GenerateResult(
                        trajectory_id=rid,
                        token_ids=res.token_ids[:end],
                        logprobs=res.logprobs[:end],
                        versions=res.versions[:end],
                        finish_reason=res.finish_reason,
                    )
                    yield chunk(rid, plen, part, 0, _finish(res, max_new) if last else None, ver)
                yield b"data: [DONE]\n\n"
            finally:
                state.rids.pop(rid, None)
                if not task.done():  # client went away: SGLang aborts the request
                    with contextlib.suppress(EngineError):
                        await state.sim.interrupt([rid])

        if stream:
            return StreamingResponse(body_stream(), media_type="text/event-stream")
        final = None
        async for piece in body_stream():
            if piece.startswith(b"data: {"):
                final = json.loads(piece[6:])
        assert final is not None
        return JSONResponse(final)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await request.json()
        if body.get("abort_all"):
            targets = [r for r in state.rids if state.sim.core.holds(r)]
        else:
            rid = body.get("rid")
            targets = [rid] if rid in state.rids and state.sim.core.holds(rid) else []
        if targets:
            await state.sim.interrupt(targets)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = {}
        with contextlib.suppress(json.JSONDecodeError):
            body = await request.json()
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            return JSONResponse({"error": {"message": f"invalid mode {mode!r}"}}, status_code=400)
        await state.sim.pause()
        if mode == "abort":
            targets = [r for r in state.rids if state.sim.core.holds(r)]
            if targets:
                await state.sim.interrupt(targets)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await state.sim.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await request.json()
        model_path = Path(body.get("model_path", ""))
        files = sorted(model_path.glob("*.safetensors")) if model_path.is_dir() else []
        if not files:
            return JSONResponse(
                {
                    "success": False,
                    "message": f"no safetensors under {model_path}",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            shapes.update({k: shape for k, (_, shape) in read_header(f).items()})
        try:
            version = int(body.get("weight_version", state.sim.version))
            await state.sim.load_weights(version, shapes)
        except (EngineError, ValueError) as exc:
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to update weights: {exc}",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights. Weight version updated to {version}.",
                "num_paused_requests": state.sim.core.num_running,
            }
        )

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": weight_version()}

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": "staleflow-standin",
            "is_generation": True,
            "weight_version": weight_version(),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> dict[str, Any]:
        snap = await state.sim.snapshot()
        return {
            "model_path": "staleflow-standin",
            "context_length": config.max_model_len,
            "max_running_requests": config.max_running,
            "max_total_num_tokens": config.kv_capacity,
            "weight_version": weight_version(),
            "internal_states": [
                {"num_running_reqs": len(snap.running), "num_waiting_reqs": snap.waiting}
            ],
            "version": STANDIN_VERSION,
        }

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = await state.sim.snapshot()
        lines = {
            "sglang:num_running_reqs": len(snap.running),
            "sglang:num_queue_reqs": snap.waiting,
            "sglang:token_usage": snap.kv_usage,
            "sglang:gen_throughput": snap.throughput_tokens_per_s,
            "sglang:max_total_num_tokens": snap.kv_capacity_tokens,
        }
        text = "".join(
            f'{k}{{model_name="staleflow-standin"}} {float(v)!r}\n' for k, v in lines.items()
        )
        return PlainTextResponse(text)

    return app


class SglangStandIn:
    """Serve the stand-in on ``127.0.0.1`` from a background thread (its own event loop).

    ::

        with SglangStandIn(SimConfig(...)) as server:
            adapter = SglangAdapter(base_url=server.base_url, ...)
    """

    def __init__(
        self, config: SimConfig | None = None, *, speed: float = 1.0, port: int = 0
    ) -> None:
        self.config = config if config is not None else SimConfig()
        self.speed = speed
        self.port = port or _free_port()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._app: Any = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        import uvicorn

        app = self._app = build_app(self.config, speed=self.speed)
        cfg = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, name="sglang-standin", daemon=True)
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout_s / 0.02)):
            if self._server.started:
                log.info("sglang_standin_started", url=self.base_url)
                return self.base_url
            if not self._thread.is_alive():
                break
            deadline.wait(0.02)
        raise RuntimeError(f"SGLang stand-in did not start on {self.base_url}")

    def fail_generations(
        self, message: str | None = "stand-in: generation failed", status: int = 500
    ) -> None:
        """Fault injection: from now on every ``/generate`` answers HTTP ``status`` with
        ``message`` while everything else (metrics, health, weights) still answers, as a
        router or gateway in front of a failing server does (SGLang itself streams a 200 and
        breaks the stream); None: serve again."""
        if self._app is None:
            raise RuntimeError("the stand-in is not started")
        self._app.state.standin.failing = None if message is None else (message, status)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> SglangStandIn:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
