"""The worker's side of the lookup service: :class:`LookupServer` answers LOOKUP, UNPIN,
PING and STATS from its :class:`CacheEngine` on a ROUTER socket (asyncio only)."""

from __future__ import annotations

import contextlib
import math
import os
import socket as socketlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Final

import anyio
import zmq
import zmq.asyncio

from lmcache_async.engine.client import check_promise_wait
from lmcache_async.errors import EngineClosedError, InvalidInputError, ProtocolError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.logging import get_logger
from lmcache_async.rpc.lookup.endpoint import DEFAULT_LOOKUP_LIMITS, lookup_endpoint
from lmcache_async.rpc.protocol import (
    ErrorCode,
    FrameLike,
    Message,
    MessageLimits,
    MessageType,
    decode,
    encode,
    error_reply,
    hashes_from_wire,
    request_id_of,
    tenant_of,
    to_wire,
    tokens_from_payload,
)

if TYPE_CHECKING:  # the scheduler's clients need no engine
    from lmcache_async.engine import CacheEngine
    from lmcache_async.engine.client import Promise

__all__ = ["DEFAULT_MAX_CONCURRENCY", "LookupServer"]

log = get_logger(__name__)

DEFAULT_MAX_CONCURRENCY: Final = 64
"""Requests a server works on at once; further ones wait in the socket's queue."""


def _refuse_if_served(path: str) -> None:
    """Raise if a live process listens on ``path``; a file left by a dead one is fine.

    ZeroMQ would silently take the path over from a live server, and two workers claiming
    one instance id and rank would answer each other's scheduler.
    """
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # no file, or nobody listening behind it
    finally:
        probe.close()
    raise InvalidInputError(
        f"another process already serves lookups on ipc://{path}: instance ids must be "
        "unique per host"
    )


class LookupServer:
    """Answers LOOKUP, UNPIN, PING and STATS requests against one :class:`CacheEngine`.
    A LOOKUP may name its prompt's tenant (``"tenant"``; none: the engine's own); one with
    ``"promise": true`` is answered by the engine's promise (``"hits"`` and ``"pending"``).

    Start it with :meth:`serve`. Each request runs in a task of its own (at most
    ``max_concurrency`` at once), so a long prompt being hashed does not hold up a ping. A
    bad message or a failing request gets an ERROR reply; the server runs on.
    """

    def __init__(
        self,
        engine: CacheEngine,
        socket: zmq.asyncio.Socket,
        *,
        endpoint: str,
        instance_id: str,
        rank: int,
        limits: MessageLimits,
        max_concurrency: int,
        prefill_speed: Callable[[], float | None] | None = None,
    ) -> None:
        self._engine = engine
        self._prefill_speed = prefill_speed
        self._socket = socket
        self._endpoint = endpoint
        self._instance_id = instance_id
        self._rank = rank
        self._limits = limits
        self._slots = anyio.Semaphore(max_concurrency)

    @classmethod
    @contextlib.asynccontextmanager
    async def serve(
        cls,
        engine: CacheEngine,
        *,
        instance_id: str,
        rank: int,
        socket_dir: str | None = None,
        limits: MessageLimits = DEFAULT_LOOKUP_LIMITS,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        prefill_speed: Callable[[], float | None] | None = None,
    ) -> AsyncIterator[LookupServer]:
        """Listen on :func:`lookup_endpoint` until the ``async with`` block ends.

        ``prefill_speed``: asked at each promise for the serving engine's prefill speed
        (tokens/s; None: unknown), which the engine's cost model weighs loads against.

        On exit the socket is closed and its file removed. A socket file left behind by a
        killed worker of the same instance id and rank is replaced.

        Raises:
            InvalidInputError: a bad argument, or the endpoint cannot be bound (for
                example ``socket_dir`` does not exist).
        """
        endpoint = lookup_endpoint(instance_id, rank, socket_dir)
        if not isinstance(limits, MessageLimits):
            raise InvalidInputError("limits must be a MessageLimits")
        if not is_strict_int(max_concurrency) or max_concurrency <= 0:
            raise InvalidInputError(
                f"max_concurrency must be a positive int, got {max_concurrency!r}"
            )
        path = endpoint.removeprefix("ipc://")
        _refuse_if_served(path)
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        bound = False
        try:
            try:
                socket.bind(endpoint)
            except zmq.ZMQError as exc:
                raise InvalidInputError(f"cannot listen on {endpoint}: {exc}") from None
            bound = True
            server = cls(
                engine,
                socket,
                endpoint=endpoint,
                instance_id=instance_id,
                rank=rank,
                limits=limits,
                max_concurrency=max_concurrency,
                prefill_speed=prefill_speed,
            )
            log.info("lookup_server_started", endpoint=endpoint, rank=rank)
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(server._receive_loop, name=f"lookup-server-{rank}")
                try:
                    yield server
                finally:
                    task_group.cancel_scope.cancel()
        finally:
            socket.close(linger=0)
            context.term()
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                log.info("lookup_server_stopped", endpoint=endpoint, rank=rank)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def rank(self) -> int:
        return self._rank

    async def _receive_loop(self) -> None:
        async with anyio.create_task_group() as task_group:
            while True:
                try:
                    frames = await self._socket.recv_multipart(copy=False)
                except zmq.ZMQError as exc:
                    if self._socket.closed:
                        return
                    log.warning("lookup_receive_failed", error=str(exc), rank=self._rank)
                    continue
                await self._slots.acquire()
                task_group.start_soon(self._handle, frames)

    async def _handle(self, frames: Sequence[FrameLike]) -> None:
        try:
            identity, body = frames[0], frames[1:]
            try:
                message = decode(
                    body,
                    max_header_bytes=self._limits.max_header_bytes,
                    max_payload_bytes=self._limits.max_payload_bytes,
                )
            except ProtocolError as exc:
                log.warning("lookup_bad_message", reason=str(exc), rank=self._rank)
                request_id = request_id_of(body, max_header_bytes=self._limits.max_header_bytes)
                reply = error_reply(request_id, ErrorCode.PROTOCOL, str(exc))
            else:
                reply = await self._answer(message)
            try:
                await self._socket.send_multipart([identity, *reply], copy=False)
            except zmq.ZMQError as exc:
                if not self._socket.closed:
                    log.warning("lookup_reply_failed", error=str(exc), rank=self._rank)
        finally:
            self._slots.release()

    async def _answer(self, message: Message) -> list[bytes | memoryview]:
        """The reply to a decoded request: its result, or an ERROR reply saying why not."""
        request_id = message.request_id
        try:
            if message.type is MessageType.LOOKUP and message.header.get("promise") is True:
                promise = await self._promise(message)
                answer = {"hits": promise.tokens, "pending": promise.pending}
                return encode(MessageType.LOOKUP, answer, request_id=request_id)
            if message.type is MessageType.LOOKUP:
                hits = await self._lookup(message)
                return encode(MessageType.LOOKUP, {"hits": hits}, request_id=request_id)
            if message.type is MessageType.UNPIN:
                lookup_id = message.header.get("lookup_id")
                if not (is_strict_int(lookup_id) or isinstance(lookup_id, str)):
                    raise ProtocolError("'lookup_id' must be an int or str")
                await self._engine.lookup_unpin(lookup_id)
                return encode(MessageType.UNPIN, request_id=request_id)
            if message.type is MessageType.PING:
                body = {"instance_id": self._instance_id, "rank": self._rank}
                return encode(MessageType.PING, body, request_id=request_id)
            if message.type is MessageType.STATS:
                body = {"rank": self._rank, "stats": to_wire(self._engine.stats())}
                return encode(MessageType.STATS, body, request_id=request_id)
            return error_reply(
                request_id,
                ErrorCode.UNSUPPORTED,
                f"a lookup server does not serve {message.type.name} requests",
            )
        except ProtocolError as exc:
            log.warning("lookup_bad_request", reason=str(exc), rank=self._rank)
            return error_reply(request_id, ErrorCode.PROTOCOL, str(exc))
        except InvalidInputError as exc:
            return error_reply(request_id, ErrorCode.INVALID_INPUT, str(exc))
        except EngineClosedError as exc:
            return error_reply(request_id, ErrorCode.ENGINE_CLOSED, str(exc))
        except Exception as exc:
            log.exception("lookup_request_failed", type=message.type.name, rank=self._rank)
            return error_reply(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _promise(self, message: Message) -> Promise:
        header = message.header
        lookup_id = header.get("lookup_id")
        if not (is_strict_int(lookup_id) or isinstance(lookup_id, str)):
            raise ProtocolError("a promise needs a 'lookup_id' (int or str)")
        computed = header.get("computed", 0)
        if not is_strict_int(computed) or computed < 0:
            raise ProtocolError("'computed' must be an int >= 0")
        finish = header.get("finish", False)
        if not isinstance(finish, bool):
            raise ProtocolError("'finish' must be a bool")
        try:
            wait = check_promise_wait(header.get("wait", 0.0))
        except InvalidInputError as exc:
            raise ProtocolError(str(exc)) from None
        if len(message.payloads) != 1:
            raise ProtocolError("a promise carries exactly one token payload frame")
        speed = self._prefill_speed() if self._prefill_speed is not None else None
        if speed is not None and not (isinstance(speed, int | float) and 0 < speed < math.inf):
            speed = None  # a meter's odd reading never fails the scheduler's promise
        return await self._engine.promise(
            tokens_from_payload(message.payloads[0]),
            lookup_id=lookup_id,
            tenant=tenant_of(header),
            computed_tokens=computed,
            prefill_tokens_per_s=speed,
            finish=finish,
            wait=wait,
        )

    async def _lookup(self, message: Message) -> int:
        header = message.header
        pin = header.get("pin", False)
        if not isinstance(pin, bool):
            raise ProtocolError("'pin' must be a bool")
        lookup_id = header.get("lookup_id")
        if lookup_id is not None and not (is_strict_int(lookup_id) or isinstance(lookup_id, str)):
            raise ProtocolError("'lookup_id' must be an int or str")
        tenant = tenant_of(header)
        if "hashes" in header:
            if message.payloads:
                raise ProtocolError("a lookup by hashes carries no payload frames")
            offsets = header.get("offsets")
            if not isinstance(offsets, list):
                raise ProtocolError("a lookup by hashes needs an 'offsets' list")
            return await self._engine.lookup(
                hashes=hashes_from_wire(header["hashes"]),
                offsets=offsets,
                lookup_id=lookup_id,
                pin=pin,
                tenant=tenant,
            )
        if len(message.payloads) != 1:
            raise ProtocolError(
                "a lookup carries 'hashes' or exactly one token payload frame, got "
                f"{len(message.payloads)} frames"
            )
        tokens = tokens_from_payload(message.payloads[0])
        return await self._engine.lookup(tokens, lookup_id=lookup_id, pin=pin, tenant=tenant)
