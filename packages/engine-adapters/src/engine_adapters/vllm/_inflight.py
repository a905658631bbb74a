"""The vLLM adapter's state of one in-flight ``generate`` call."""

from __future__ import annotations

import asyncio
from typing import Any

from engine_adapters._contract import GenerateRequest, GenerateResult


class InFlight:
    """Adapter-side state of one in-flight ``generate`` call."""

    __slots__ = (
        "added",
        "done",
        "interrupt_requested",
        "logprobs",
        "queue",
        "request",
        "request_id",
        "seen_versions",
        "submit_version",
        "token_ids",
    )

    def __init__(self, request: GenerateRequest, request_id: str, submit_version: int) -> None:
        self.request = request
        self.request_id = request_id
        self.submit_version = submit_version
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.seen_versions: list[int] = []  # fallback only, if vLLM reports no spans
        self.added = False
        self.queue: Any = None  # vLLM's output collector once the request is added
        self.interrupt_requested = False
        self.done: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()

    @property
    def started(self) -> bool:
        return bool(self.token_ids)
