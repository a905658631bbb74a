"""Async clients: :class:`TrajectoryClient` over TCP and :class:`InProcessTrajectoryClient`.

Both have the same methods, mirroring :class:`~trajectory_server.TrajectoryStore`, and raise the
same exception classes (a server-side ``WrongOwner`` is raised as ``WrongOwner`` here, with its
context attributes). The in-process client wraps a store directly for tests and single-process
runs; by default it still encodes and decodes every message, so it accepts exactly what the TCP
client accepts.

The TCP client pipelines: many coroutines may call it at once; each request carries an id and
responses are matched to their callers. ``connect`` authenticates the connection first (the
``hello`` of :mod:`trajectory_server._handshake`): a wrong token fails there, with
``Unauthorized``. When the server closes idle connections, the client pings it before that
happens, so a connection that is merely quiet stays open.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, overload

from engine_adapters import SamplingParams
from trajectory_server import _handshake, _requests, _wire
from trajectory_server._core import ALL_LEVELS, TrajectoryStore
from trajectory_server._dispatch import Dispatcher
from trajectory_server._groups import GroupByKey
from trajectory_server._packed import as_int_array
from trajectory_server._records import (
    Completion,
    FinishedTrajectory,
    LedgerEvent,
    Location,
    QueueEntry,
    Segment,
    StoreStats,
    Trajectory,
    id_tuple,
    json_value,
)
from trajectory_server._service import LENGTH
from trajectory_server.errors import (
    ConfigError,
    MessageTooLarge,
    ServiceClosed,
    TrajectoryServerError,
    TransportError,
)

#: How long :meth:`TrajectoryClient.close` lets buffered bytes drain before it cuts the
#: connection (a server that stopped reading would hold it open otherwise).
CLOSE_WAIT_S = 5.0
#: About how many bytes of prompt tokens one :meth:`put_prompts` request carries.
PUT_FRAME_BYTES = 4 << 20


class _Client(abc.ABC):
    """The shared API; subclasses implement :meth:`_call`."""

    def __init__(self) -> None:
        # bytes on the wire by request type: [requests, sent, received] (see wire_bytes)
        self._wire_bytes: dict[str, list[int]] = {}

    @abc.abstractmethod
    async def _call(self, req: Any) -> Any: ...

    def wire_bytes(self) -> dict[str, dict[str, int]]:
        """The bytes this client sent and received, by request type: ``{type: {"requests",
        "sent", "received"}}``, each frame with its length prefix, the handshake left out
        (an in-process client with ``wire=False`` encodes nothing and counts nothing)."""
        names = ("requests", "sent", "received")
        return {t: dict(zip(names, c, strict=True)) for t, c in self._wire_bytes.items()}

    def _counted(self, kind: str, sent: int, received: int) -> None:
        c = self._wire_bytes.setdefault(kind, [0, 0, 0])
        c[0] += 1
        c[1] += sent
        c[2] += received

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def ping(self) -> dict[str, Any]:
        return await self._call(_requests.Ping())  # type: ignore[no-any-return]

    async def submit(self, trajectories: Sequence[Trajectory]) -> tuple[str, ...]:
        return await self._call(_requests.Submit(trajectories=tuple(trajectories)))  # type: ignore[no-any-return]

    async def submit_group(
        self,
        group_id: str,
        prompt_token_ids: Iterable[int] | None,
        n: int,
        *,
        sampling: SamplingParams | None = None,
        metadata: Mapping[str, Any] | None = None,
        target_lengths: Sequence[int] | None = None,
        prompt_key: int | None = None,
        echo: bool = True,
    ) -> Any:
        """``TrajectoryStore.submit_group``: the prompt as its token ids, or (``None`` for
        them) as ``prompt_key``, a key :meth:`put_prompts` put it under. Answers the members'
        ids; with ``echo=False`` their count (a caller that knows the ids, ``group_id/i``)."""
        req = _requests.SubmitGroup(
            group_id=group_id,
            prompt_token_ids=None if prompt_token_ids is None else as_int_array(prompt_token_ids),
            n=n,
            sampling=sampling if sampling is not None else SamplingParams(),
            metadata=json_value(dict(metadata or {})),
            target_lengths=None if target_lengths is None else tuple(target_lengths),
            prompt_key=prompt_key,
            echo=echo,
        )
        return await self._call(req)

    async def submit_groups(
        self,
        groups: Sequence[GroupByKey],
        *,
        sampling: SamplingParams | None = None,
        skip_existing: bool = False,
    ) -> int:
        """``TrajectoryStore.submit_groups``: groups by prompt key in one request, the sampling
        parameters sent once; answers how many trajectories were submitted."""
        req = _requests.SubmitGroups(
            groups=tuple(groups),
            sampling=sampling if sampling is not None else SamplingParams(),
            skip_existing=skip_existing,
        )
        return await self._call(req)  # type: ignore[no-any-return]

    async def put_prompts(
        self,
        prompts: Iterable[tuple[int, Iterable[int], Mapping[str, Any] | None]],
        *,
        frame_bytes: int = PUT_FRAME_BYTES,
    ) -> int:
        """Put ``(key, prompt token ids, metadata or None)`` items into the store's prompt
        table (``TrajectoryStore.prompts``), in requests of about ``frame_bytes`` each (each
        all or none); returns how many were put. A key put again replaces its prompt."""
        done, batch, size = 0, [], 0
        for key, ids, meta in prompts:
            tokens = as_int_array(ids)
            batch.append((key, tokens, None if meta is None else json_value(dict(meta))))
            size += len(tokens) * tokens.itemsize + 64
            if size >= frame_bytes:
                done += await self._put(batch)
                batch, size = [], 0
        if batch:
            done += await self._put(batch)
        return done

    async def _put(self, batch: Sequence[tuple[int, Any, Any]]) -> int:
        keys, tokens, metadata = zip(*batch, strict=True)
        req = _requests.PutPrompts(keys=keys, prompt_token_ids=tokens, metadata=metadata)
        return await self._call(req)  # type: ignore[no-any-return]

    async def route(
        self, instance_id: str, trajectory_ids: Sequence[str], version: int
    ) -> tuple[Trajectory, ...]:
        req = _requests.Route(
            instance_id=instance_id, trajectory_ids=id_tuple(trajectory_ids), version=version
        )
        return await self._call(req)  # type: ignore[no-any-return]

    async def return_partial(
        self, instance_id: str, segments: Sequence[Segment]
    ) -> tuple[QueueEntry, ...]:
        req = _requests.ReturnPartial(instance_id=instance_id, segments=tuple(segments))
        return await self._call(req)  # type: ignore[no-any-return]

    @overload
    async def finish(
        self, instance_id: str, completions: Sequence[Completion]
    ) -> tuple[FinishedTrajectory, ...]: ...

    @overload
    async def finish(
        self, instance_id: str, completions: Sequence[Completion], *, echo: Literal[True]
    ) -> tuple[FinishedTrajectory, ...]: ...

    @overload
    async def finish(
        self, instance_id: str, completions: Sequence[Completion], *, echo: Literal[False]
    ) -> int: ...

    @overload
    async def finish(
        self, instance_id: str, completions: Sequence[Completion], *, echo: bool
    ) -> tuple[FinishedTrajectory, ...] | int: ...

    async def finish(
        self, instance_id: str, completions: Sequence[Completion], *, echo: bool = True
    ) -> tuple[FinishedTrajectory, ...] | int:
        """Running -> finished; answers the finished records whole, or with ``echo=False``
        only how many finished (an engine that wrote the tokens needs nothing back)."""
        req = _requests.Finish(instance_id=instance_id, completions=tuple(completions), echo=echo)
        return await self._call(req)  # type: ignore[no-any-return]

    async def drop(self, trajectory_ids: Sequence[str], reason: str) -> None:
        await self._call(_requests.Drop(trajectory_ids=id_tuple(trajectory_ids), reason=reason))

    async def drop_group(self, group_id: str, reason: str) -> tuple[str, ...]:
        return await self._call(_requests.DropGroup(group_id=group_id, reason=reason))  # type: ignore[no-any-return]

    async def instance_lost(self, instance_id: str) -> tuple[str, ...]:
        return await self._call(_requests.InstanceLost(instance_id=instance_id))  # type: ignore[no-any-return]

    async def release(self, trajectory_ids: Sequence[str]) -> tuple[FinishedTrajectory, ...]:
        return await self._call(_requests.Release(trajectory_ids=id_tuple(trajectory_ids)))  # type: ignore[no-any-return]

    async def free(self, trajectory_ids: Sequence[str]) -> int:
        """Free finished payloads read elsewhere (:meth:`finished`) without receiving them: what
        :meth:`release` does, answered with the count freed."""
        return await self._call(_requests.Free(trajectory_ids=id_tuple(trajectory_ids)))  # type: ignore[no-any-return]

    async def finished(
        self, trajectory_ids: Sequence[str] | None = None
    ) -> tuple[FinishedTrajectory, ...]:
        ids = None if trajectory_ids is None else id_tuple(trajectory_ids)
        return await self._call(_requests.GetFinished(trajectory_ids=ids))  # type: ignore[no-any-return]

    async def finished_ids(self) -> tuple[str, ...]:
        """The ids of the unreleased finished trajectories, without their payloads."""
        return await self._call(_requests.FinishedIds())  # type: ignore[no-any-return]

    async def queue_view(
        self, limit: int | None = None, *, level: Any = ALL_LEVELS
    ) -> tuple[QueueEntry, ...]:
        return await self._call(_requests.QueueView(limit=limit, level=level))  # type: ignore[no-any-return]

    async def stats(self) -> StoreStats:
        return await self._call(_requests.Stats())  # type: ignore[no-any-return]

    async def level_counts(self) -> dict[int | None, int]:
        return (await self.stats()).queued_by_level

    async def locate(self, trajectory_ids: Sequence[str]) -> tuple[Location, ...]:
        return await self._call(_requests.Locate(trajectory_ids=id_tuple(trajectory_ids)))  # type: ignore[no-any-return]

    async def location(self, trajectory_id: str) -> Location:
        return (await self.locate([trajectory_id]))[0]

    async def get(self, trajectory_id: str) -> Trajectory:
        return (await self._call(_requests.Get(trajectory_ids=(trajectory_id,))))[0]  # type: ignore[no-any-return]

    async def history(self, trajectory_id: str) -> tuple[LedgerEvent, ...]:
        return await self._call(_requests.History(trajectory_id=trajectory_id))  # type: ignore[no-any-return]

    async def held_by(self, instance_id: str) -> tuple[str, ...]:
        return await self._call(_requests.HeldBy(instance_id=instance_id))  # type: ignore[no-any-return]

    async def group(self, group_id: str) -> tuple[str, ...]:
        return await self._call(_requests.Group(group_id=group_id))  # type: ignore[no-any-return]

    async def save_checkpoint(self) -> str:
        """Ask the server to checkpoint to its configured path; returns that path."""
        return await self._call(_requests.SaveCheckpoint())  # type: ignore[no-any-return]


class InProcessTrajectoryClient(_Client):
    """Same interface, wrapping a store (or dispatcher) in this process.

    ``wire=True`` (default) sends every request through encode → dispatcher → decode, exactly as
    the TCP client would; ``wire=False`` calls the store directly (faster, for simulations).
    """

    def __init__(
        self,
        store: TrajectoryStore | Dispatcher | None = None,
        *,
        token: str | None = None,
        wire: bool = True,
    ) -> None:
        super().__init__()
        self.dispatcher = store if isinstance(store, Dispatcher) else Dispatcher(store)
        self.token = token
        self.wire = wire
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def store(self) -> TrajectoryStore:
        return self.dispatcher.store

    async def close(self) -> None:
        self._closed = True

    async def _call(self, req: Any) -> Any:
        if self._closed:
            raise ServiceClosed("the client is closed")
        if not self.wire:
            self.dispatcher.authorize(self.token)
            return self.dispatcher.execute(req)
        rid = next(self._ids)
        sent = _wire.encode_request(req, rid, self.token)
        data = self.dispatcher.handle_frame(sent)
        self._counted(req.TYPE, LENGTH.size + len(sent), LENGTH.size + len(data))
        return _unwrap(req, rid, _wire.decode_response(data))


class TrajectoryClient(_Client):
    """Talks to a :class:`~trajectory_server.service.TrajectoryService` over TCP."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        token: str | None,
        max_message_bytes: int,
        timeout_s: float | None,
        idle_timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        self._reader = reader
        self._writer = writer
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Any, asyncio.Future[Any]]] = {}
        self._write_lock = asyncio.Lock()
        self._failure: TrajectoryServerError | None = None
        self._last_sent = asyncio.get_running_loop().time()
        self._reader_task = asyncio.create_task(self._read_loop())
        self._keepalive_task = (
            None
            if idle_timeout_s is None
            else asyncio.create_task(self._keepalive(idle_timeout_s / 3))
        )

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        token: str | None = None,
        max_message_bytes: int = _wire.DEFAULT_MAX_MESSAGE_BYTES,
        timeout_s: float | None = 60.0,
    ) -> TrajectoryClient:
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(
                f"timeout_s must be > 0 or None, got {timeout_s!r}", field="timeout_s"
            )
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            raise TransportError(
                f"cannot connect to trajectory server at {host}:{port}: {exc}", host=host, port=port
            ) from exc
        try:
            async with asyncio.timeout(timeout_s):
                welcome = await _authenticate(reader, writer, token, max_message_bytes)
        except BaseException as exc:
            writer.close()
            if isinstance(exc, TimeoutError):
                raise TransportError(
                    f"no answer to the handshake from {host}:{port} within {timeout_s} s",
                    host=host,
                    port=port,
                ) from exc
            if isinstance(exc, asyncio.IncompleteReadError | OSError):
                raise TransportError(
                    f"trajectory server at {host}:{port} closed the connection during the "
                    f"handshake: {exc!r}",
                    host=host,
                    port=port,
                ) from exc
            raise
        return cls(
            reader,
            writer,
            token=token,
            max_message_bytes=min(max_message_bytes, welcome.max_message_bytes),
            timeout_s=timeout_s,
            idle_timeout_s=welcome.idle_timeout_s,
        )

    @property
    def failure(self) -> TrajectoryServerError | None:
        """Why this connection ended (lost, refused by the server, closed), None while it is
        open: once set, every call raises it at once without sending anything."""
        return self._failure

    async def close(self) -> None:
        if self._failure is None:
            self._failure = ServiceClosed("the client is closed")
        for task in (self._reader_task, self._keepalive_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._writer.close()
        try:  # what is still buffered goes out first; a peer that reads nothing gets cut
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self._writer.wait_closed()
        except TimeoutError:
            self._writer.transport.abort()
        except Exception:  # the connection is being closed anyway
            pass
        self._fail_pending()

    async def _call(self, req: Any) -> Any:
        if self._failure is not None:
            raise self._ended(self._failure)
        rid = next(self._ids)
        data = _wire.encode_request(req, rid)  # the hello authenticated this connection
        if len(data) > self.max_message_bytes:
            raise MessageTooLarge(
                f"{req.TYPE} request of {len(data)} bytes exceeds the limit of "
                f"{self.max_message_bytes}",
                size=len(data),
                limit=self.max_message_bytes,
            )
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (req, future)
        try:
            async with self._write_lock:
                if self._failure is not None:  # ended while this call waited for its turn
                    raise self._ended(self._failure)
                self._writer.write(LENGTH.pack(len(data)))
                self._writer.write(data)
                self._counted(req.TYPE, LENGTH.size + len(data), 0)
                self._last_sent = asyncio.get_running_loop().time()
                sending = asyncio.timeout(self.timeout_s)
                try:
                    async with sending:
                        await self._writer.drain()
                except TimeoutError as exc:
                    if not sending.expired():
                        raise  # the socket's own timeout: the connection is lost
                    # the server stopped reading with the frame partly sent: nothing more
                    # can be sent on this connection (this request was not carried out)
                    self._abandon(f"could not send {req.TYPE} within {self.timeout_s} s")
                    raise TransportError(
                        f"could not send {req.TYPE} within {self.timeout_s} s: the connection "
                        "is closed",
                        request_id=rid,
                    ) from exc
            answering = asyncio.timeout(self.timeout_s)
            try:
                async with answering:
                    return await future
            except TimeoutError as exc:
                if not answering.expired():
                    raise
                raise TransportError(  # the connection stays: a late answer is dropped
                    f"no response to {req.TYPE} within {self.timeout_s} s", request_id=rid
                ) from exc
        except (ConnectionError, OSError) as exc:
            raise TransportError(f"connection lost during {req.TYPE}: {exc}") from exc
        finally:
            self._pending.pop(rid, None)
            if future.done() and not future.cancelled():
                future.exception()  # failed for a call that raised before reading it
            else:
                future.cancel()

    def _abandon(self, why: str) -> None:
        """End the connection at once (without waiting for the peer): every pending and
        later call fails, with ``why`` as the reason."""
        if self._failure is None:
            self._failure = TransportError(f"connection to the trajectory server ended: {why}")
        self._writer.transport.abort()
        self._fail_pending()

    async def _read_loop(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(LENGTH.size)
                (size,) = LENGTH.unpack(header)
                if size > self.max_message_bytes:
                    raise MessageTooLarge(
                        f"response of {size} bytes exceeds the limit of {self.max_message_bytes}",
                        size=size,
                        limit=self.max_message_bytes,
                    )
                frame = _wire.decode_response(
                    await self._reader.readexactly(size), max_bytes=self.max_message_bytes
                )
                pending = self._pending.get(frame.request_id)
                if pending is None:
                    if not frame.ok and frame.request_id == 0:
                        raise frame.body  # the server refused the connection (e.g. too large)
                    continue  # the caller timed out and left
                req, future = pending
                self._wire_bytes.setdefault(req.TYPE, [0, 0, 0])[2] += LENGTH.size + size
                if future.done():
                    continue
                try:
                    future.set_result(_unwrap(req, frame.request_id, frame))
                except TrajectoryServerError as exc:
                    future.set_exception(exc)
        except asyncio.CancelledError:
            raise
        except TrajectoryServerError as exc:
            if self._failure is None:  # else it ended on purpose: that reason stands
                self._failure = exc
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            if self._failure is None:
                self._failure = TransportError(f"connection to the trajectory server lost: {exc!r}")
        finally:
            self._fail_pending()

    async def _keepalive(self, every_s: float) -> None:
        """Ping when nothing was sent for ``every_s``, so the server's idle timeout never hits a
        connection that is merely quiet; stops once the connection failed."""
        loop = asyncio.get_running_loop()
        while self._failure is None:
            quiet = loop.time() - self._last_sent
            if quiet < every_s:
                await asyncio.sleep(every_s - quiet)
                continue
            try:
                await self.ping()
            except TrajectoryServerError:
                return

    @staticmethod
    def _ended(failure: TrajectoryServerError) -> TrajectoryServerError:
        """A fresh copy of the error a connection ended with, for one call to raise."""
        return type(failure)(failure.message, **failure.context)

    def _fail_pending(self) -> None:
        failure = self._failure or TransportError("connection to the trajectory server lost")
        for _req, future in list(self._pending.values()):
            if not future.done():
                future.set_exception(self._ended(failure))


async def _authenticate(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str | None, max_bytes: int
) -> _handshake.Welcome:
    hello = _handshake.encode_hello(token)
    writer.write(LENGTH.pack(len(hello)) + hello)
    await writer.drain()
    (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if size > _handshake.PRE_AUTH_MAX_BYTES:
        raise MessageTooLarge(
            f"handshake answer of {size} bytes exceeds {_handshake.PRE_AUTH_MAX_BYTES}",
            size=size,
            limit=_handshake.PRE_AUTH_MAX_BYTES,
        )
    return _handshake.decode_welcome(
        await reader.readexactly(size), max_bytes=min(max_bytes, _handshake.PRE_AUTH_MAX_BYTES)
    )


def _unwrap(req: Any, rid: int, frame: _wire.ResponseFrame) -> Any:
    if frame.request_id != rid:
        raise TransportError(f"response id {frame.request_id} does not match request {rid}")
    if not frame.ok:
        raise frame.body
    return _wire.decode_result(req, frame.body)
