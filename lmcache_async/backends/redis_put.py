"""The write path of the Redis/Valkey tier: batches of records sent as ``SET NX``.

On a standalone server a batch's ``SET`` commands are written to the socket straight from
the objects' memory (:func:`~.redis_records.set_commands`); on a cluster the records are
copied into a reused buffer and the cluster pipeline splits the batch by node. Either way
the next batch is encoded while this one is sent (:func:`~.redis_records.overlapped`), and
each batch's replies go to a callback that counts what the server stored.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import anyio
import anyio.to_thread

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.memory.pool import MemoryObj

from .record import RecordSpec
from .redis_conn import RedisConnection
from .redis_records import (
    INLINE_BYTES,
    Commands,
    Encoded,
    encode_into,
    overlapped,
    set_commands,
)

__all__ = ["RecordWriter", "Stored"]

_SCRATCH_BUFFERS: Final = 2
"""Encoding buffers kept for reuse by cluster puts (one per concurrent put; more are made
as needed)."""

Stored = Callable[[Sequence[ChunkKey], Sequence[int], Sequence[Any]], Awaitable[int]]
"""``stored(keys, record sizes, SET replies)`` of one batch; returns how many were new."""


class RecordWriter:
    """Sends the records of a put, batch by batch, with ``PX ttl_ms`` when given; each
    batch's replies go to ``stored``. Puts to a cluster encode into up to two reused
    buffers (kept until :meth:`clear`)."""

    def __init__(self, conn: RedisConnection, ttl_ms: int | None, stored: Stored) -> None:
        self._conn = conn
        self._ttl_ms = ttl_ms
        self._stored = stored
        self._scratch: list[bytearray] = []

    async def write(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        rkeys: Sequence[bytes],
        batches: Sequence[Sequence[int]],
        spec: RecordSpec,
    ) -> int:
        """``SET NX`` the records of ``objs[i]`` for ``i`` in each batch in turn under
        ``rkeys[i]``; returns what ``stored`` counted.

        Raises:
            TierUnavailableError: Redis is unreachable or did not answer in time.
            TierError: Redis reported another error.
        """
        if self._conn.cluster:
            return await self._put_copied(keys, objs, rkeys, batches, spec)
        return await self._put_direct(keys, objs, rkeys, batches, spec)

    def clear(self) -> None:
        """Drop the reused buffers."""
        self._scratch.clear()

    # -- standalone: SET commands written from the objects' memory ------------------------

    async def _put_direct(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        rkeys: Sequence[bytes],
        batches: Sequence[Sequence[int]],
        spec: RecordSpec,
    ) -> int:
        """Put on a standalone server: each batch's ``SET`` commands go out with every
        large payload written from its object's memory, never copied in user space.

        The references are held for the whole put: views on the objects pass from the
        encoding stage to the sending one, and a batch encoded but never sent (the put
        failed or was cancelled) is simply dropped.
        """
        held = [objs[i].ref() for batch in batches for i in batch]
        added = 0

        async def encode(n: int) -> Commands:
            indices = batches[n]
            args = (
                [rkeys[i] for i in indices],
                [keys[i] for i in indices],
                [objs[i] for i in indices],
                spec,
                self._ttl_ms,
            )
            if sum(objs[i].nbytes for i in indices) > INLINE_BYTES:
                # Not cancellable: the objects must outlive the thread that reads them.
                return await anyio.to_thread.run_sync(set_commands, *args)
            return set_commands(*args)

        async def send(n: int, commands: Commands) -> bool:
            nonlocal added
            write = functools.partial(
                self._conn.write_packed, commands.buffers, len(commands.sizes)
            )
            replies = await self._conn.call("set", write, sum(commands.sizes))
            added += await self._stored([keys[i] for i in batches[n]], commands.sizes, replies)
            return False

        try:
            await overlapped(len(batches), encode, send)
        finally:
            for obj in held:
                obj.unref()
        return added

    # -- cluster: records copied into scratch buffers, sent by the cluster pipeline -------

    async def _put_copied(
        self,
        keys: Sequence[ChunkKey],
        objs: Sequence[MemoryObj],
        rkeys: Sequence[bytes],
        batches: Sequence[Sequence[int]],
        spec: RecordSpec,
    ) -> int:
        """Put on a cluster: each batch's records are copied into a reused buffer and sent
        by the cluster pipeline, which splits them by node (the direct path above talks to
        one connection of one server)."""
        added = 0

        async def encode(n: int) -> Encoded:
            indices = batches[n]
            buffer = self._scratch.pop() if self._scratch else bytearray()
            return await _encode_batch(
                buffer, [keys[i] for i in indices], [objs[i] for i in indices], spec
            )

        async def send(n: int, encoded: Encoded) -> bool:
            nonlocal added
            indices = batches[n]
            added += await self._send_batch(
                [keys[i] for i in indices], [rkeys[i] for i in indices], encoded
            )
            # Reused only once the server has answered: a send cut short may leave views
            # on the buffer in the transport's queue, still to be flushed.
            if len(self._scratch) < _SCRATCH_BUFFERS:
                self._scratch.append(encoded.buffer)
            return False

        await overlapped(len(batches), encode, send)
        return added

    async def _send_batch(
        self, keys: Sequence[ChunkKey], rkeys: Sequence[bytes], encoded: Encoded
    ) -> int:
        """SET NX the records of one batch in one round trip; returns how many were new."""
        view = memoryview(encoded.buffer)
        values = [view[a:b] for a, b in itertools.pairwise([0, *encoded.ends])]

        def build(pipe: Any) -> None:
            for rkey, value in zip(rkeys, values, strict=True):
                pipe.set(rkey, value, nx=True, px=self._ttl_ms)

        results = await self._conn.pipelined("set", build, encoded.ends[-1])
        return await self._stored(keys, [len(value) for value in values], results)


async def _encode_batch(
    buffer: bytearray, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj], spec: RecordSpec
) -> Encoded:
    """The records of ``objs`` one after the other in ``buffer`` (or a larger one)."""
    held = [obj.ref() for obj in objs]
    try:
        if sum(obj.nbytes for obj in held) > INLINE_BYTES:
            # Not cancellable: the objects must outlive the thread that reads them.
            buffer, ends = await anyio.to_thread.run_sync(encode_into, buffer, keys, held, spec)
        else:
            buffer, ends = encode_into(buffer, keys, held, spec)
    finally:
        for obj in held:
            obj.unref()
    return Encoded(buffer, ends)
