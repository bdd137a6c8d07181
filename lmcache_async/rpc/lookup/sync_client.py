"""The scheduler's lookup client for synchronous callers (:class:`SyncLookupClient`), as
vLLM's scheduler is: plain blocking ZeroMQ sockets, one poll over every rank."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

import zmq

from lmcache_async.engine.client import Promise
from lmcache_async.keys.tokens import Tokens
from lmcache_async.logging import get_logger
from lmcache_async.rpc.lookup.core import DEFAULT_LOOKUP_TIMEOUT, Call, ClientCore
from lmcache_async.rpc.lookup.endpoint import DEFAULT_LOOKUP_LIMITS, LookupId
from lmcache_async.rpc.protocol import Message, MessageLimits

__all__ = ["SyncLookupClient"]

log = get_logger(__name__)

T = TypeVar("T")


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
        self._core = ClientCore(instance_id, world_size, socket_dir, timeout, limits)
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

    def _fan_out(self, call: Call[T]) -> T:
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
        tenant: str | None = None,
    ) -> int:
        """As :meth:`LookupClient.lookup`, blocking."""
        return self._fan_out(
            self._core.lookup(tokens, hashes, offsets, lookup_id, pin, tenant=tenant)
        )

    def promise(
        self,
        tokens: Tokens,
        *,
        lookup_id: LookupId,
        tenant: str | None = None,
        computed_tokens: int = 0,
        finish: bool = False,
        wait: float = 0.0,
    ) -> Promise:
        """As :meth:`LookupClient.promise`, blocking."""
        return self._fan_out(
            self._core.promise(
                tokens,
                lookup_id,
                tenant=tenant,
                computed_tokens=computed_tokens,
                finish=finish,
                wait=wait,
            )
        )

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
