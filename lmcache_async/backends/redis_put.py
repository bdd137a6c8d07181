"""The write path of the Redis/Valkey tier: a put's records sent as ``SET NX`` on the bulk
path (:mod:`.redis_wire`), from the objects' memory.

One worker thread encodes the records (each header with the checksum of its payload),
in order, a couple ahead of the sending (:class:`Encodings`); it starts as the put does,
so the first checksums are computed while the tier still asks which keys the server
already holds. Records go out pipelined (on a cluster, each primary's on its own
connection, the primaries at once), a payload stored as is straight from its object.
The server's answers are read once every record is sent; each batch's go to a callback
that counts what was stored and keeps the quotas.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Final

import anyio
import anyio.to_thread

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.memory.pool import MemoryObj

from .record import RecordSpec
from .redis_conn import RedisConnection
from .redis_records import INLINE_BYTES
from .redis_wire import Outgoing

__all__ = ["LOOKAHEAD", "Encodings", "Plan", "RecordWriter", "Stored"]

LOOKAHEAD: Final = 2
"""Records the encoding thread may have ready that the sending has not taken yet."""

Stored = Callable[[Sequence[ChunkKey], Sequence[int], Sequence[Any]], Awaitable[int]]
"""``stored(keys, record sizes, SET replies)`` of one batch; returns how many were new."""

Plan = Callable[[], Awaitable[list[list[int]]]]
"""``plan()``: the batches of indices to send (ascending), decided once the put began."""


class RecordWriter:
    """Sends the records of a put with ``PX ttl_ms`` when given; each batch's replies go
    to ``stored`` (serialized) once all of them are in."""

    def __init__(self, conn: RedisConnection, ttl_ms: int | None, stored: Stored) -> None:
        self._conn = conn
        self._ttl_ms = ttl_ms
        self._stored = stored
        self._lock = anyio.Lock()

    async def write(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        rkeys: Sequence[bytes],
        spec: RecordSpec,
        plan: Plan,
    ) -> int:
        """``SET NX`` the record of ``objs[i]`` under ``rkeys[i]`` for ``i`` in the batches
        ``plan()`` returns (the encoding of the first records starts before it does);
        returns what ``stored`` counted. A put cut short counts the batches whose answers
        all came back.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        async with encodings(keys, objs, spec) as records:
            batches = await plan()
            order = [i for batch in batches for i in batch]
            records.drop(set(range(len(keys))).difference(order))
            if not order:
                return 0
            return await self._send(keys, objs, rkeys, batches, records)

    async def _send(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        rkeys: Sequence[bytes],
        batches: Sequence[Sequence[int]],
        records: Encodings,
    ) -> int:
        order = [i for batch in batches for i in batch]
        batch_of = {i: n for n, batch in enumerate(batches) for i in batch}
        waiting = [len(batch) for batch in batches]
        replies: dict[int, bool] = {}
        added = 0

        async def replied(i: int, stored: bool) -> None:
            nonlocal added
            replies[i] = stored
            n = batch_of[i]
            waiting[n] -= 1
            if waiting[n] == 0:
                batch = batches[n]
                async with self._lock:
                    added += await self._stored(
                        [keys[j] for j in batch],
                        [records.size(j) for j in batch],
                        [replies[j] for j in batch],
                    )

        await self._conn.set_records(
            [rkeys[i] for i in order],
            order,
            records.take,
            replied,
            nbytes=sum(objs[i].nbytes for i in order),
            ttl_ms=self._ttl_ms,
        )
        return added


class Encodings:
    """The records of a put, encoded in index order by one worker thread (or on the
    loop, for a small put) ahead of the sending: :meth:`take` waits for one, and lets the
    thread encode one more; :meth:`drop` says which will never be taken (already stored,
    or refused), so the thread skips them."""

    def __init__(self, count: int, encode: Callable[[int], Outgoing], *, inline: bool) -> None:
        self._encode = encode
        self._inline = inline
        self._loop = asyncio.get_running_loop()
        self._ready: list[asyncio.Future[Outgoing]] = [
            self._loop.create_future() for _ in range(count)
        ]
        self._dropped: set[int] = set()
        self._sizes: dict[int, int] = {}
        self._slots = threading.Semaphore(LOOKAHEAD)
        self._stop = threading.Event()

    async def take(self, i: int) -> Outgoing:
        """The record of ``i`` (ascending ``i`` from one caller)."""
        if self._inline:
            out = self._encode(i)
        else:
            out = await self._ready[i]
            self._slots.release()
        self._sizes[i] = out.size
        return out

    def size(self, i: int) -> int:
        """The length of the record of ``i``, once taken."""
        return self._sizes[i]

    def drop(self, indices: Iterable[int]) -> None:
        """Records that will not be taken: not encoded, or their slot given back."""
        for i in indices:
            self._dropped.add(i)
            if self._ready[i].done():
                self._slots.release()

    def work(self) -> None:
        """The thread's loop: each record not dropped, in order, once a slot is free."""
        for i, ready in enumerate(self._ready):
            if i in self._dropped:
                continue
            self._slots.acquire()
            if self._stop.is_set():
                return
            result: Outgoing | Exception
            try:
                result = self._encode(i)
            except Exception as exc:
                result = exc
            self._loop.call_soon_threadsafe(self._deliver, i, ready, result)

    def _deliver(
        self, i: int, ready: asyncio.Future[Outgoing], result: Outgoing | Exception
    ) -> None:
        if ready.done():
            return
        if i in self._dropped:
            self._slots.release()  # dropped while it was encoded
        elif isinstance(result, Exception):
            ready.set_exception(result)
        else:
            ready.set_result(result)

    def stop(self) -> None:
        """Let the thread end (it stops before its next record)."""
        self._stop.set()
        self._slots.release(len(self._ready) + LOOKAHEAD)

    def retrieved(self) -> None:
        """Mark every error as seen (the sending may have stopped before taking it)."""
        for ready in self._ready:
            if ready.done() and not ready.cancelled():
                ready.exception()


@contextlib.asynccontextmanager
async def encodings(
    keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], spec: RecordSpec
) -> AsyncIterator[Encodings]:
    """The :class:`Encodings` of ``objs``' records under ``keys``, its thread running for
    the block (a put of at most :data:`~.redis_records.INLINE_BYTES` is encoded on the
    loop instead). The objects are referenced, and the thread has stopped, until the
    block exits, whatever happened in it: views on the objects pass to the sending."""

    def encode(i: int) -> Outgoing:
        return Outgoing(*spec.encode(keys[i], objs[i]))

    inline = sum(obj.nbytes for obj in objs) <= INLINE_BYTES
    records = Encodings(len(objs), encode, inline=inline)
    held = [obj.ref() for obj in objs]
    error: Exception | None = None
    try:
        if inline:
            yield records
            return
        async with anyio.create_task_group() as tg:
            # Not cancellable: the objects must outlive the thread that reads them.
            tg.start_soon(anyio.to_thread.run_sync, records.work)
            try:
                yield records
            except Exception as exc:
                error = exc  # raised as is below, not in an exception group
            finally:
                records.stop()
        records.retrieved()
    finally:
        for obj in held:
            obj.unref()
    if error is not None:
        raise error
