"""The record pipeline of the Redis/Valkey tier: records encoded for ``SET``, fetched values
checked and decoded, and the overlap of CPU work with network I/O.

Each chunk is one string value, ``record header ‖ payload``
(:mod:`~lmcache_async.backends.record`). On the way out a batch becomes either ``SET``
commands ready for the wire with large payloads left as views on their objects
(:func:`set_commands`, standalone servers), or records copied one after the other into a
reused buffer (:func:`encode_into`, clusters). On the way in, :class:`RecordLoader` checks
each value's header against its key and layout, allocates pool memory, and verifies and
decodes the payload into it. Large batches do their checksums, copies and codecs in worker
threads, never on the event loop. :func:`overlapped` runs such a stage beside the network
stage so that batch *n + 1* is prepared while batch *n* is sent or fetched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import anyio
import anyio.to_thread
import numpy as np

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool, waited_in_vain

from ..errors import AllocationTimeoutError, ForeignRecordError, IntegrityError
from .record import RecordHeader, RecordSpec
from .redis_conn import WRITE_PIECE

__all__ = [
    "INLINE_BYTES",
    "Commands",
    "Encoded",
    "RecordLoader",
    "encode_into",
    "overlapped",
    "set_commands",
]

log = get_logger(__name__)

INLINE_BYTES: Final = 256 * 1024
"""Batches with fewer payload bytes are checked and copied on the loop (a thread hop costs
more than the work)."""

T = TypeVar("T")


@dataclass(slots=True)
class _Loaded:
    """A record fetched for a key, with the object allocated for its payload."""

    index: int
    header: RecordHeader
    payload: memoryview
    obj: MemoryObj


@dataclass(slots=True)
class Encoded:
    """The records of one put batch: ``buffer[ends[i-1]:ends[i]]`` is record ``i``."""

    buffer: bytearray
    ends: list[int]


@dataclass(slots=True)
class Commands:
    """The ``SET`` commands of one standalone put batch, ready for the wire: ``buffers``
    in order are the bytes to send (large payloads as views on their objects' memory);
    ``sizes[i]`` is the length of record ``i``."""

    buffers: list[bytearray | memoryview]
    sizes: list[int]


async def overlapped(
    count: int,
    first: Callable[[int], Awaitable[T]],
    second: Callable[[int, T], Awaitable[bool]],
) -> None:
    """Run ``second(n, await first(n))`` for ``n`` in ``range(count)``, in order, with
    ``first(n + 1)`` running while ``second(n)`` does (network I/O beside CPU work).

    ``second`` returning True stops the run. The first error of either stage is raised
    as is (not in an exception group) once the other stage has stopped; what ``first``
    produced and ``second`` never saw is dropped, so ``first`` must not hand over
    anything that needs releasing.
    """
    if count <= 1:
        if count:
            await second(0, await first(0))
        return
    errors: list[Exception] = []
    send, receive = anyio.create_memory_object_stream[tuple[int, T]]()

    async def produce() -> None:
        async with send:
            for n in range(count):
                try:
                    item = await first(n)
                except Exception as exc:
                    errors.append(exc)
                    return
                try:
                    await send.send((n, item))
                except anyio.BrokenResourceError:
                    return  # the consumer stopped

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        try:
            async with receive:
                async for n, item in receive:
                    if await second(n, item):
                        break
        except Exception as exc:
            errors.insert(0, exc)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]


def set_commands(
    rkeys: Sequence[bytes],
    keys: Sequence[ChunkKey],
    objs: Sequence[MemoryObj],
    spec: RecordSpec,
    ttl_ms: int | None,
) -> Commands:
    """The RESP of ``SET <rkey> <header ‖ payload> NX [PX <ttl_ms>]`` for each record.

    A value is sent as two buffers behind one bulk-string length, so a payload of at
    least :data:`~.redis_conn.WRITE_PIECE` bytes stays a view on its object; smaller ones
    are joined with the small parts around them, which saves a socket write each.
    """
    options = b"$2\r\nNX\r\n"
    if ttl_ms is not None:
        ttl = str(ttl_ms).encode()
        options += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    start = b"*%d\r\n$3\r\nSET\r\n" % (4 if ttl_ms is None else 6)
    buffers: list[bytearray | memoryview] = []
    sizes: list[int] = []
    joined = bytearray()
    for rkey, key, obj in zip(rkeys, keys, objs, strict=True):
        header, payload = spec.encode(key, obj)
        view = memoryview(payload).cast("B")
        size = len(header) + len(view)
        joined += b"%s$%d\r\n%s\r\n$%d\r\n" % (start, len(rkey), rkey, size)
        joined += header
        if len(view) < WRITE_PIECE:
            joined += view
        else:
            buffers += (joined, view)
            joined = bytearray()
        joined += b"\r\n" + options
        sizes.append(size)
    buffers.append(joined)
    return Commands(buffers, sizes)


def encode_into(
    buffer: bytearray,
    keys: Sequence[ChunkKey],
    objs: Sequence[MemoryObj],
    spec: RecordSpec,
) -> tuple[bytearray, list[int]]:
    """Write each ``header ‖ payload`` record, one after the other, into ``buffer`` (a
    fresh one when it is too small); returns the buffer and where each record ends.

    This is the one copy a value costs on the way out. It lands in a buffer reused from
    batch to batch, whose pages are already mapped: a fresh ``header + payload`` per
    value costs page faults on every batch, and measured several times slower.
    """
    parts = [spec.encode(key, obj) for key, obj in zip(keys, objs, strict=True)]
    total = sum(len(header) + len(payload) for header, payload in parts)
    if len(buffer) < total:
        buffer = bytearray(max(total, len(buffer) * 2))
    # numpy copies without holding the GIL, so the event loop runs on meanwhile.
    out = np.frombuffer(buffer, dtype=np.uint8)
    ends: list[int] = []
    at = 0
    for header, payload in parts:
        for piece in (header, payload):
            np.copyto(out[at : at + len(piece)], np.frombuffer(piece, dtype=np.uint8))
            at += len(piece)
        ends.append(at)
    return buffer, ends


class RecordLoader:
    """Turns fetched values into pool objects: header checked against the key and the
    layout (``spec``), memory allocated (waiting up to ``allocation_timeout`` seconds),
    payload verified and decoded."""

    def __init__(self, pool: MemoryPool, spec: RecordSpec, allocation_timeout: float) -> None:
        self._pool = pool
        self._spec = spec
        self._allocation_timeout = allocation_timeout

    async def load(
        self,
        keys: Sequence[ChunkKey],
        batch: range,
        values: Sequence[bytes | None],
        out: list[MemoryObj | None],
    ) -> tuple[bool, list[tuple[int, str, bool]]]:
        """Check one fetched batch (``values`` of ``keys[i]`` for ``i`` in ``batch``) and
        decode it into ``out``, each object with one reference for the caller.

        Returns:
            Whether memory ran out (the batch's later values were not loaded), and the
            unreadable values: ``(index, reason, foreign)`` each (``foreign``: sealed under
            another key, to be left in place).
        """
        loaded: list[_Loaded] = []
        bad: list[tuple[int, str, bool]] = []
        exhausted = False
        try:
            for index, value in zip(batch, values, strict=True):
                if value is None:
                    continue
                try:
                    header, offset = RecordHeader.from_bytes(value)
                    self._spec.check_header(header, keys[index])
                except IntegrityError as exc:
                    bad.append((index, str(exc), isinstance(exc, ForeignRecordError)))
                    continue
                try:
                    obj = await self._pool.allocate(
                        header.shape, self._spec.dtype, timeout=self._allocation_timeout
                    )
                except AllocationTimeoutError:
                    (log.warning if waited_in_vain() else log.debug)(
                        "redis_get_allocation_timeout",
                        loaded=len(loaded),
                        skipped=len(keys) - index,
                        timeout=self._allocation_timeout,
                    )
                    exhausted = True
                    break
                loaded.append(_Loaded(index, header, memoryview(value)[offset:], obj))
            nbytes = sum(len(item.payload) for item in loaded)
            if nbytes > INLINE_BYTES:
                # Not cancellable: the objects must outlive the thread that writes them.
                failures = await anyio.to_thread.run_sync(self._decode, loaded)
            else:
                failures = self._decode(loaded)
        except BaseException:
            for item in loaded:
                item.obj.unref()
            raise
        for item in loaded:
            reason = failures.get(item.index)
            if reason is None:
                out[item.index] = item.obj
            else:
                item.obj.unref()
                bad.append((item.index, reason, False))
        return exhausted, bad

    def _decode(self, loaded: Sequence[_Loaded]) -> dict[int, str]:
        """Verify and decode payloads into their objects; returns failures by index."""
        failures: dict[int, str] = {}
        for item in loaded:
            try:
                self._spec.verify_payload(item.header, item.payload)
                self._spec.decode_into(item.header, item.payload, item.obj.tensor)
            except IntegrityError as exc:
                failures[item.index] = str(exc)
        return failures
