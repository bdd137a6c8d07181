"""The lookup service: the scheduler asks every worker rank how much of a prompt is cached.

Each worker process runs a :class:`LookupServer` (a ROUTER socket on an ``ipc://`` path
derived from an instance id and the rank) answering from its :class:`CacheEngine`. The
scheduler holds a :class:`LookupClient` (async) or :class:`SyncLookupClient` (blocking, for
vLLM's synchronous scheduler) with one DEALER socket per rank. A lookup goes to every rank
at once and the answer is the minimum, because a prefix is only usable when every rank has
its share of it. A rank that does not answer within the timeout counts as 0 hits (and is
logged); the call never hangs and never raises for it.

:class:`LookupServer` and :class:`LookupClient` run on asyncio only (``zmq.asyncio``), not
on trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import re
import socket as socketlib
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import anyio
import structlog
import zmq
import zmq.asyncio

from lmcache_async.errors import (
    EngineClosedError,
    InvalidInputError,
    ProtocolError,
)
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
    hashes_to_wire,
    request_id_of,
    to_wire,
    tokens_from_payload,
    tokens_payload,
)
from lmcache_async.tokens import Tokens, is_strict_int

if TYPE_CHECKING:  # the scheduler's clients need no engine
    from lmcache_async.engine import CacheEngine

__all__ = [
    "DEFAULT_LOOKUP_LIMITS",
    "DEFAULT_LOOKUP_TIMEOUT",
    "DEFAULT_MAX_CONCURRENCY",
    "LookupClient",
    "LookupId",
    "LookupServer",
    "SyncLookupClient",
    "lookup_endpoint",
]

log = structlog.get_logger(__name__)

T = TypeVar("T")
LookupId = int | str
"""Lookup ids cross the wire, so they are ints or strings."""

DEFAULT_LOOKUP_TIMEOUT: Final = 1.0
"""Seconds a client waits for all ranks before counting the silent ones as 0 hits."""
DEFAULT_LOOKUP_LIMITS: Final = MessageLimits(max_header_bytes=1 << 20, max_payload_bytes=64 << 20)
"""Lookup messages: a 1 MiB header (block hashes) and 64 MiB of tokens (16M tokens)."""
DEFAULT_MAX_CONCURRENCY: Final = 64
"""Requests a server works on at once; further ones wait in the socket's queue."""

_INSTANCE_ID: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_UNIX_PATH_MAX: Final = 107  # sun_path holds 108 bytes with the final NUL
_RECONNECT_IVL_MS: Final = 100


def lookup_endpoint(instance_id: str, rank: int, socket_dir: str | None = None) -> str:
    """``ipc://{socket_dir}/lmcache-async-{instance_id}-{rank}.lookup``.

    ``socket_dir`` defaults to the system's temporary directory.

    Raises:
        InvalidInputError: ``instance_id`` is empty, longer than 64 characters or has a
            character outside ``[A-Za-z0-9_.-]``; ``rank`` is not a non-negative int;
            ``socket_dir`` is not a str; or the path is too long for a unix socket.
    """
    if not isinstance(instance_id, str) or not _INSTANCE_ID.fullmatch(instance_id):
        raise InvalidInputError(
            f"instance_id must be 1-64 characters of [A-Za-z0-9_.-], got {instance_id!r:.80}"
        )
    if not is_strict_int(rank) or rank < 0:
        raise InvalidInputError(f"rank must be a non-negative int, got {rank!r}")
    if socket_dir is not None and not isinstance(socket_dir, str):
        raise InvalidInputError(f"socket_dir must be a str, got {type(socket_dir).__name__}")
    directory = socket_dir if socket_dir is not None else tempfile.gettempdir()
    path = os.path.join(directory, f"lmcache-async-{instance_id}-{rank}.lookup")
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise InvalidInputError(
            f"socket path {path!r} is longer than {_UNIX_PATH_MAX} bytes, the unix socket "
            "limit: use a shorter socket_dir or instance_id"
        )
    return f"ipc://{path}"


def _check_lookup_id(lookup_id: object) -> LookupId:
    if isinstance(lookup_id, (int, str)) and not isinstance(lookup_id, bool):
        return lookup_id
    raise InvalidInputError(f"lookup_id must be an int or str, got {type(lookup_id).__name__}")


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


# -- server ----------------------------------------------------------------------------------


class LookupServer:
    """Answers LOOKUP, UNPIN, PING and STATS requests against one :class:`CacheEngine`.

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
    ) -> None:
        self._engine = engine
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
    ) -> AsyncIterator[LookupServer]:
        """Listen on :func:`lookup_endpoint` until the ``async with`` block ends.

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

    async def _lookup(self, message: Message) -> int:
        header = message.header
        pin = header.get("pin", False)
        if not isinstance(pin, bool):
            raise ProtocolError("'pin' must be a bool")
        lookup_id = header.get("lookup_id")
        if lookup_id is not None and not (is_strict_int(lookup_id) or isinstance(lookup_id, str)):
            raise ProtocolError("'lookup_id' must be an int or str")
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
            )
        if len(message.payloads) != 1:
            raise ProtocolError(
                "a lookup carries 'hashes' or exactly one token payload frame, got "
                f"{len(message.payloads)} frames"
            )
        tokens = tokens_from_payload(message.payloads[0])
        return await self._engine.lookup(tokens, lookup_id=lookup_id, pin=pin)


# -- clients ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call(Generic[T]):
    """One request fanned out to every rank: its frames, and how the replies become a result.

    ``finisher`` gets the call and one entry per rank: the reply, or None for a rank that
    did not answer.
    """

    op: str
    request_id: int
    frames: list[bytes | memoryview] | None  # None: answered without asking the ranks
    expected: MessageType
    finisher: Callable[[_Call[T], list[Message | None]], T]

    def finish(self, replies: list[Message | None]) -> T:
        return self.finisher(self, replies)


class _ClientCore:
    """What both clients share: validation, message building, reply matching, results."""

    def __init__(
        self,
        instance_id: str,
        world_size: int,
        socket_dir: str | None,
        timeout: float,
        limits: MessageLimits,
    ) -> None:
        if not is_strict_int(world_size) or world_size <= 0:
            raise InvalidInputError(f"world_size must be a positive int, got {world_size!r}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise InvalidInputError(f"timeout must be a positive number of seconds: {timeout!r}")
        if not isinstance(limits, MessageLimits):
            raise InvalidInputError("limits must be a MessageLimits")
        self.endpoints = [lookup_endpoint(instance_id, r, socket_dir) for r in range(world_size)]
        self.timeout = float(timeout)
        self.limits = limits
        self._ids = itertools.count(1)
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the lookup client is closed")

    def configure(self, socket: zmq.Socket[Any], rank: int) -> None:
        """DEALER options, then connect. ``IMMEDIATE`` queues nothing for a rank that is not
        connected, so no stale request reaches a worker that restarts later."""
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        socket.connect(self.endpoints[rank])

    def match(self, frames: Sequence[FrameLike], call: _Call[Any], rank: int) -> Message | None:
        """The reply to ``call`` among received frames; None for anything else (a stale
        reply to an earlier, abandoned request, or garbage), which the caller drops."""
        try:
            message = decode(
                frames,
                max_header_bytes=self.limits.max_header_bytes,
                max_payload_bytes=self.limits.max_payload_bytes,
            )
        except ProtocolError as exc:
            log.warning("lookup_bad_reply", rank=rank, reason=str(exc))
            return None
        if message.request_id != call.request_id:
            log.debug("lookup_stale_reply", rank=rank, request_id=message.request_id)
            return None
        return message

    def timed_out(self, call: _Call[Any], rank: int) -> None:
        log.warning(
            "lookup_rank_timeout",
            op=call.op,
            rank=rank,
            endpoint=self.endpoints[rank],
            timeout_s=self.timeout,
        )

    def _result(self, call: _Call[Any], rank: int, reply: Message | None) -> Message | None:
        """A rank's reply of the expected type, or None (logged) when it failed.

        Raises:
            InvalidInputError: the rank refused the request's arguments.
        """
        if reply is None:
            return None
        if reply.type is MessageType.ERROR:
            code = reply.header.get("code")
            text = str(reply.header.get("message", ""))
            if code == ErrorCode.INVALID_INPUT:
                raise InvalidInputError(f"rank {rank}: {text}")
            log.warning("lookup_rank_error", op=call.op, rank=rank, code=code, message=text)
            return None
        if reply.type is not call.expected:
            log.warning("lookup_unexpected_reply", op=call.op, rank=rank, type=reply.type.name)
            return None
        return reply

    def _call(
        self,
        op: str,
        msg_type: MessageType,
        header: dict[str, Any] | None,
        payloads: Sequence[object],
        finish: Callable[[_Call[T], list[Message | None]], T],
    ) -> _Call[T]:
        request_id = next(self._ids)
        frames = encode(msg_type, header, payloads, request_id=request_id)
        return _Call(op, request_id, frames, msg_type, finish)

    def lookup(
        self,
        tokens: Tokens | None,
        hashes: Sequence[int | bytes] | None,
        offsets: Sequence[int] | None,
        lookup_id: LookupId | None,
        pin: bool,
    ) -> _Call[int]:
        self.check_open()
        if not isinstance(pin, bool):
            raise InvalidInputError(f"pin must be a bool, got {type(pin).__name__}")
        header: dict[str, Any] = {"pin": pin}
        if lookup_id is not None:
            header["lookup_id"] = _check_lookup_id(lookup_id)
        elif pin:
            raise InvalidInputError("pin=True needs a lookup_id")
        payloads: list[memoryview] = []
        if hashes is not None:
            if tokens is not None:
                raise InvalidInputError("pass either tokens or hashes, not both")
            if offsets is None:
                raise InvalidInputError("hashes need offsets (the end token offset of each hash)")
            if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence):
                raise InvalidInputError(f"offsets must be a sequence, got {type(offsets).__name__}")
            for index, end in enumerate(offsets):
                if not is_strict_int(end):
                    raise InvalidInputError(f"offsets[{index}] must be an int, got {end!r:.40}")
            header["hashes"] = hashes_to_wire(hashes)
            header["offsets"] = list(offsets)
        else:
            if tokens is None:
                raise InvalidInputError("tokens (or hashes with offsets) are required")
            if offsets is not None:
                raise InvalidInputError("offsets go with hashes, not with tokens")
            payloads.append(tokens_payload(tokens))
        call = self._call("lookup", MessageType.LOOKUP, header, payloads, self._finish_lookup)
        if (hashes is not None and not header["hashes"]) or (payloads and not payloads[0].nbytes):
            call.frames = None  # nothing to look up: 0 hits without a round trip
        return call

    def _finish_lookup(self, call: _Call[int], replies: list[Message | None]) -> int:
        if call.frames is None:
            return 0
        hits: list[int] = []
        for rank, reply in enumerate(replies):
            message = self._result(call, rank, reply)
            value = message.header.get("hits") if message is not None else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                log.warning("lookup_bad_reply", rank=rank, reason="'hits' is not an int >= 0")
                value = 0
            hits.append(value)
        return min(hits)

    def unpin(self, lookup_id: LookupId) -> _Call[None]:
        self.check_open()
        header = {"lookup_id": _check_lookup_id(lookup_id)}
        return self._call("unpin", MessageType.UNPIN, header, (), self._finish_all)

    def _finish_all(self, call: _Call[None], replies: list[Message | None]) -> None:
        for rank, reply in enumerate(replies):
            self._result(call, rank, reply)

    def ping(self) -> _Call[list[bool]]:
        self.check_open()
        return self._call("ping", MessageType.PING, None, (), self._finish_ping)

    def _finish_ping(self, call: _Call[list[bool]], replies: list[Message | None]) -> list[bool]:
        return [self._result(call, rank, reply) is not None for rank, reply in enumerate(replies)]

    def stats(self) -> _Call[list[dict[str, Any] | None]]:
        self.check_open()
        return self._call("stats", MessageType.STATS, None, (), self._finish_stats)

    def _finish_stats(
        self, call: _Call[list[dict[str, Any] | None]], replies: list[Message | None]
    ) -> list[dict[str, Any] | None]:
        result: list[dict[str, Any] | None] = []
        for rank, reply in enumerate(replies):
            message = self._result(call, rank, reply)
            stats = message.header.get("stats") if message is not None else None
            result.append(stats if isinstance(stats, dict) else None)
        return result


class _AsyncRank:
    """One rank's DEALER socket. One request at a time; a timeout replaces the socket, so
    a request still queued is dropped and a late reply never reaches the new socket."""

    def __init__(self, core: _ClientCore, context: zmq.asyncio.Context, rank: int) -> None:
        self._core = core
        self._context = context
        self._rank = rank
        self._lock = asyncio.Lock()
        self._socket = self._connect()

    def _connect(self) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.DEALER)
        self._core.configure(socket, self._rank)
        return socket

    def close(self) -> None:
        self._socket.close(linger=0)

    async def exchange(self, call: _Call[Any], deadline: float) -> Message | None:
        """Send ``call`` and wait for its reply until ``deadline`` (loop time); never raises
        but for cancellation."""
        frames = call.frames
        if frames is None:
            return None
        try:
            async with asyncio.timeout_at(deadline):
                await self._lock.acquire()
        except TimeoutError:
            self._core.timed_out(call, self._rank)
            return None
        try:
            async with asyncio.timeout_at(deadline):
                await self._socket.send_multipart(frames, copy=False)
                while True:
                    received = await self._socket.recv_multipart(copy=False)
                    reply = self._core.match(received, call, self._rank)
                    if reply is not None:
                        return reply
        except TimeoutError:
            self._core.timed_out(call, self._rank)
            self._reconnect()
        except zmq.ZMQError as exc:
            if not self._core.closed:  # else the client was closed under this call
                log.warning("lookup_rank_failed", op=call.op, rank=self._rank, error=str(exc))
            self._reconnect()
        finally:
            self._lock.release()
        return None

    def _reconnect(self) -> None:
        """Start afresh: the request may still be queued, or its reply on the way."""
        self._socket.close(linger=0)
        if not self._core.closed:
            self._socket = self._connect()


class LookupClient:
    """The scheduler's side of the lookup service, for an asyncio event loop.

    ``LookupClient(instance_id, world_size)`` connects to ranks ``0..world_size-1`` of
    the instance (they may start later, restart, or be down). Use it as an async context
    manager or call :meth:`aclose`. Concurrent calls are fine; each rank serves them one
    at a time. Every call returns within ``timeout`` seconds.

    Raises:
        InvalidInputError: a bad argument.
    """

    def __init__(
        self,
        instance_id: str,
        world_size: int,
        *,
        socket_dir: str | None = None,
        timeout: float = DEFAULT_LOOKUP_TIMEOUT,
        limits: MessageLimits = DEFAULT_LOOKUP_LIMITS,
    ) -> None:
        self._core = _ClientCore(instance_id, world_size, socket_dir, timeout, limits)
        self._context = zmq.asyncio.Context()
        self._ranks = [_AsyncRank(self._core, self._context, r) for r in range(world_size)]

    @property
    def endpoints(self) -> list[str]:
        return list(self._core.endpoints)

    async def _fan_out(self, call: _Call[T]) -> T:
        if call.frames is None:
            return call.finish([])
        deadline = asyncio.get_running_loop().time() + self._core.timeout
        if len(self._ranks) == 1:
            replies = [await self._ranks[0].exchange(call, deadline)]
        else:
            replies = list(
                await asyncio.gather(*(rank.exchange(call, deadline) for rank in self._ranks))
            )
        return call.finish(replies)

    async def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        lookup_id: LookupId | None = None,
        pin: bool = False,
    ) -> int:
        """Prefix tokens cached on every rank: the minimum of the ranks' answers.

        ``tokens`` (a list of int, 1-D integer tensor or ndarray) or the serving engine's
        block ``hashes`` with their end ``offsets``. With ``pin=True`` and a ``lookup_id``
        each rank pins what it found until :meth:`unpin` (call it whatever this returns:
        a rank may hold pins beyond the minimum). A rank that does not answer in time or
        fails counts as 0 hits (logged).

        Raises:
            InvalidInputError: bad input, found here or by a rank's engine.
            EngineClosedError: the client is closed.
        """
        return await self._fan_out(self._core.lookup(tokens, hashes, offsets, lookup_id, pin))

    async def unpin(self, lookup_id: LookupId) -> None:
        """Release every rank's pins for ``lookup_id``; a rank that fails is logged."""
        await self._fan_out(self._core.unpin(lookup_id))

    async def ping(self) -> list[bool]:
        """Whether each rank answered within the timeout."""
        return await self._fan_out(self._core.ping())

    async def stats(self) -> list[dict[str, Any] | None]:
        """Each rank's engine stats as a plain map (None for a rank that did not answer)."""
        return await self._fan_out(self._core.stats())

    async def aclose(self) -> None:
        """Close the sockets; idempotent. Later calls raise EngineClosedError."""
        if self._core.closed:
            return
        self._core.closed = True
        for rank in self._ranks:
            rank.close()
        self._context.term()

    async def __aenter__(self) -> LookupClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class SyncLookupClient:
    """:class:`LookupClient` for synchronous callers (plain blocking ZeroMQ sockets).

    Same constructor and methods, blocking; safe to call from several threads (calls are
    serialised). Every call returns within ``timeout`` seconds.
    """

    def __init__(
        self,
        instance_id: str,
        world_size: int,
        *,
        socket_dir: str | None = None,
        timeout: float = DEFAULT_LOOKUP_TIMEOUT,
        limits: MessageLimits = DEFAULT_LOOKUP_LIMITS,
    ) -> None:
        self._core = _ClientCore(instance_id, world_size, socket_dir, timeout, limits)
        self._context: zmq.Context[zmq.Socket[Any]] = zmq.Context()
        self._sockets = [self._connect(r) for r in range(world_size)]
        self._lock = threading.Lock()

    @property
    def endpoints(self) -> list[str]:
        return list(self._core.endpoints)

    def _connect(self, rank: int) -> zmq.Socket[Any]:
        socket = self._context.socket(zmq.DEALER)
        self._core.configure(socket, rank)
        return socket

    def _fan_out(self, call: _Call[T]) -> T:
        frames = call.frames
        if frames is None:
            return call.finish([])
        with self._lock:
            self._core.check_open()
            deadline = time.monotonic() + self._core.timeout
            replies: list[Message | None] = [None] * len(self._sockets)
            rank_of = {socket: rank for rank, socket in enumerate(self._sockets)}
            poller = zmq.Poller()
            for socket in self._sockets:
                poller.register(socket, zmq.POLLOUT)
            to_send = set(rank_of)
            waiting: set[zmq.Socket[Any]] = set()
            try:
                while to_send or waiting:
                    left_ms = math.ceil((deadline - time.monotonic()) * 1000)
                    if left_ms <= 0:
                        break
                    for socket, event in poller.poll(left_ms):
                        rank = rank_of[socket]
                        if event & zmq.POLLOUT and socket in to_send:
                            try:
                                socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                            except zmq.Again:  # the peer went away since the poll
                                continue
                            to_send.discard(socket)
                            waiting.add(socket)
                            poller.modify(socket, zmq.POLLIN)
                        elif event & zmq.POLLIN:
                            received = socket.recv_multipart(copy=False)
                            reply = self._core.match(received, call, rank)
                            if reply is not None:
                                replies[rank] = reply
                                waiting.discard(socket)
                                poller.unregister(socket)
            except zmq.ZMQError as exc:
                log.warning("lookup_failed", op=call.op, error=str(exc))
            for socket in to_send | waiting:
                rank = rank_of[socket]
                self._core.timed_out(call, rank)
                socket.close(linger=0)
                self._sockets[rank] = self._connect(rank)
        return call.finish(replies)

    def lookup(
        self,
        tokens: Tokens | None = None,
        *,
        hashes: Sequence[int | bytes] | None = None,
        offsets: Sequence[int] | None = None,
        lookup_id: LookupId | None = None,
        pin: bool = False,
    ) -> int:
        """As :meth:`LookupClient.lookup`, blocking."""
        return self._fan_out(self._core.lookup(tokens, hashes, offsets, lookup_id, pin))

    def unpin(self, lookup_id: LookupId) -> None:
        """As :meth:`LookupClient.unpin`, blocking."""
        self._fan_out(self._core.unpin(lookup_id))

    def ping(self) -> list[bool]:
        """As :meth:`LookupClient.ping`, blocking."""
        return self._fan_out(self._core.ping())

    def stats(self) -> list[dict[str, Any] | None]:
        """As :meth:`LookupClient.stats`, blocking."""
        return self._fan_out(self._core.stats())

    def close(self) -> None:
        """Close the sockets; idempotent. Later calls raise EngineClosedError."""
        with self._lock:
            if self._core.closed:
                return
            self._core.closed = True
            for socket in self._sockets:
                socket.close(linger=0)
            self._context.term()

    def __enter__(self) -> SyncLookupClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
