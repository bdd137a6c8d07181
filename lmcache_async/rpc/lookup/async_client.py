"""The scheduler's lookup client for an asyncio event loop (:class:`LookupClient`): one
DEALER socket per rank, a lookup fanned out to all of them at once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from lmcache_async.engine.client import Promise
from lmcache_async.keys.tokens import Tokens
from lmcache_async.logging import get_logger
from lmcache_async.rpc.lookup.core import DEFAULT_LOOKUP_TIMEOUT, Call, ClientCore
from lmcache_async.rpc.lookup.endpoint import DEFAULT_LOOKUP_LIMITS, LookupId
from lmcache_async.rpc.protocol import Message, MessageLimits

__all__ = ["LookupClient"]

log = get_logger(__name__)

T = TypeVar("T")


class _AsyncRank:
    """One rank's DEALER socket. One request at a time; a timeout replaces the socket, so
    a request still queued is dropped and a late reply never reaches the new socket."""

    def __init__(self, core: ClientCore, context: zmq.asyncio.Context, rank: int) -> None:
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

    async def exchange(self, call: Call[Any], deadline: float) -> Message | None:
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
        self._core = ClientCore(instance_id, world_size, socket_dir, timeout, limits)
        self._context = zmq.asyncio.Context()
        self._ranks = [_AsyncRank(self._core, self._context, r) for r in range(world_size)]

    @property
    def endpoints(self) -> list[str]:
        return list(self._core.endpoints)

    async def _fan_out(self, call: Call[T]) -> T:
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
        tenant: str | None = None,
    ) -> int:
        """Prefix tokens cached on every rank: the minimum of the ranks' answers.

        ``tokens`` (a list of int, 1-D integer tensor or ndarray) or the serving engine's
        block ``hashes`` with their end ``offsets``. With ``pin=True`` and a ``lookup_id``
        each rank pins what it found until :meth:`unpin` (call it whatever this returns:
        a rank may hold pins beyond the minimum). ``tenant``: whose prompt it is (None:
        each rank's own tenant). A rank that does not answer in time or fails counts as 0
        hits (logged).

        Raises:
            InvalidInputError: bad input, found here or by a rank's engine.
            EngineClosedError: the client is closed.
        """
        return await self._fan_out(
            self._core.lookup(tokens, hashes, offsets, lookup_id, pin, tenant=tenant)
        )

    async def promise(
        self,
        tokens: Tokens,
        *,
        lookup_id: LookupId,
        tenant: str | None = None,
        computed_tokens: int = 0,
        finish: bool = False,
        wait: float = 0.0,
    ) -> Promise:
        """How many prompt tokens every rank can load for ``lookup_id``: each rank's
        engine promises only chunks verified in host memory (:meth:`CacheEngine.promise
        <lmcache_async.CacheEngine.promise>`), pinned under ``lookup_id``. The fewest
        tokens of any rank; pending while any rank's prefetch runs (ask again;
        ``finish=True`` ends them; ``wait``: seconds each rank may wait for its reads to
        end before it answers pending). ``computed_tokens``: prompt tokens the serving
        engine has already. A rank that does not answer in time counts 0 tokens, not pending.

        Raises:
            InvalidInputError: bad input, found here or by a rank's engine.
            EngineClosedError: the client is closed.
        """
        return await self._fan_out(
            self._core.promise(
                tokens,
                lookup_id,
                tenant=tenant,
                computed_tokens=computed_tokens,
                finish=finish,
                wait=wait,
            )
        )

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
