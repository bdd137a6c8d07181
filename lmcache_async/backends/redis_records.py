"""The records of the Redis/Valkey tier as they arrive: each fetched value checked and
decoded into pool memory while it streams in.

Each chunk is one string value, ``record header ‖ payload``
(:mod:`~lmcache_async.backends.record`). :class:`RecordLoads` is what a get's values are
fed to (the :class:`~.redis_wire.ValueSink` of the bulk ``GET``): it reads a value's
header first, checks it against the key and the layout, allocates the pool object, then
has the payload received. A payload stored as is (codec ``none``, no cipher) lands in
its object directly, and its checksum is computed piece by piece as the pieces land (each
fresh in the cache; no second pass over the memory, no thread), so it is verified the
moment its last byte is in, before the next value is read. Any other payload lands in
the connection's reusable buffer and is verified and decoded from there (in a worker
thread when large) before that buffer takes the next value. A value that fails is a
miss, reported for deletion; nothing of it stays allocated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Final

import anyio.to_thread

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool, waited_in_vain

from ..errors import AllocationTimeoutError, ForeignRecordError, IntegrityError
from .codec import Codec
from .record import PREFIX_SIZE, RecordHeader, RecordSpec, payload_hasher
from .redis_wire import BulkValue

__all__ = ["INLINE_BYTES", "RecordLoader", "RecordLoads"]

log = get_logger(__name__)

INLINE_BYTES: Final = 256 * 1024
"""Payloads of fewer bytes are encoded and decoded on the loop (a thread hop costs more
than the work)."""

Pause = Callable[[], AbstractContextManager[None]]
"""Stops the call's deadline while memory is waited for (see :meth:`RecordLoads.receiving`)."""


class RecordLoader:
    """What turns fetched records into pool objects for one tier: the records expected
    (``spec``), the pool, and how long to wait for its memory (``allocation_timeout``)."""

    def __init__(self, pool: MemoryPool, spec: RecordSpec, allocation_timeout: float) -> None:
        self.pool = pool
        self.spec = spec
        self.allocation_timeout = allocation_timeout

    def loads(
        self, keys: Sequence[ChunkKey], out: list[MemoryObj | None], *, prefix: bool
    ) -> RecordLoads:
        """The sink of one get of ``keys``, filling ``out``; with ``prefix`` it loads
        nothing after the first value missing or unreadable."""
        return RecordLoads(self, keys, out, prefix=prefix)


class RecordLoads:
    """The values of one get turned into pool objects as they arrive: ``out[i]`` gets the
    object of ``keys[i]``, with one reference for the caller (who releases it, whatever
    happens, along with any other object in ``out``).

    :attr:`stop`: values from this index on are not loaded (set by the first miss or
    unreadable value of a prefix read, and where memory ran out: :attr:`exhausted`).
    :attr:`bad`: the unreadable values, ``(index, reason, foreign)`` each (``foreign``:
    sealed under another key, to be left in place).
    """

    def __init__(
        self,
        loader: RecordLoader,
        keys: Sequence[ChunkKey],
        out: list[MemoryObj | None],
        *,
        prefix: bool,
    ) -> None:
        self._loader = loader
        self._keys = keys
        self._out = out
        self._prefix = prefix
        self.stop = len(keys)
        self.exhausted = False
        self.bad: list[tuple[int, str, bool]] = []
        self._pause: Pause = contextlib.nullcontext

    @property
    def max_value(self) -> int:
        return self._loader.spec.max_record_bytes

    def wanted(self, index: int) -> bool:
        return index < self.stop

    @contextlib.contextmanager
    def receiving(self, pause: Pause) -> Iterator[None]:
        """The scope of one network call feeding this sink: ``pause()`` is entered around
        each wait for memory, so that a pool under pressure does not pass for a server
        too slow."""
        self._pause = pause
        try:
            yield
        finally:
            self._pause = contextlib.nullcontext

    async def value(self, index: int, value: BulkValue | None) -> None:
        """Load the value of ``keys[index]`` (None: absent)."""
        if value is None:
            self._stop(index)
            return
        spec = self._loader.spec
        try:
            header = await self._header(self._keys[index], value)
        except IntegrityError as exc:
            self._refuse(index, str(exc), isinstance(exc, ForeignRecordError))
            return
        obj = await self._allocate(index, header)
        if obj is None:
            return
        self._out[index] = obj
        try:
            if _direct(header):
                hasher = payload_hasher()
                await value.read_into(obj.data, hasher.update)
                spec.verify_checksum(header, hasher.intdigest())
            else:
                payload = value.spare(header.length)
                await value.read_into(payload)
                # The buffer takes the next value: decoded before that one is read.
                if header.length > INLINE_BYTES:
                    # Not cancellable: the object must outlive the thread that writes it.
                    await anyio.to_thread.run_sync(_decode, spec, header, payload, obj)
                else:
                    _decode(spec, header, payload, obj)
        except IntegrityError as exc:
            self._out[index] = None
            obj.unref()
            self._refuse(index, str(exc), False)

    async def _header(self, key: ChunkKey, value: BulkValue) -> RecordHeader:
        """Read and check the header of ``value``; what is left of it is the payload."""
        if value.size < PREFIX_SIZE:
            raise IntegrityError(f"record of {value.size} bytes is shorter than its prefix")
        prefix = await value.read_exact(PREFIX_SIZE)
        size = RecordHeader.size_from_prefix(prefix)
        if size > value.size:
            raise IntegrityError("record header is truncated")
        header, _ = RecordHeader.from_bytes(prefix + await value.read_exact(size - PREFIX_SIZE))
        spec = self._loader.spec
        spec.check_header(header, key)
        if value.left != header.length:
            raise IntegrityError(
                f"record payload is {value.left} bytes, its header says {header.length}"
            )
        if _direct(header) and spec.raw_size(header) != header.length:
            raise IntegrityError("record payload does not fill its tensor")
        return header

    async def _allocate(self, index: int, header: RecordHeader) -> MemoryObj | None:
        loader = self._loader
        # Memory free now is taken without stopping the call's clock (which reschedules
        # its timer twice), as most values' is; only a wait for room stops it.
        obj = loader.pool.allocate_nowait(header.shape, loader.spec.dtype)
        if obj is not None:
            return obj
        try:
            with self._pause():
                return await loader.pool.allocate(
                    header.shape, loader.spec.dtype, timeout=loader.allocation_timeout
                )
        except AllocationTimeoutError:
            (log.warning if waited_in_vain() else log.debug)(
                "redis_get_allocation_timeout",
                skipped=len(self._keys) - index,
                timeout=loader.allocation_timeout,
            )
            self.exhausted = True
            self.stop = min(self.stop, index)
            return None

    def _stop(self, index: int) -> None:
        if self._prefix:
            self.stop = min(self.stop, index)

    def _refuse(self, index: int, reason: str, foreign: bool) -> None:
        self.bad.append((index, reason, foreign))
        self._stop(index)


def _direct(header: RecordHeader) -> bool:
    """Whether the payload is the tensor's bytes as they are (received into the object)."""
    return header.codec == Codec.NONE and not header.sealed


def _decode(spec: RecordSpec, header: RecordHeader, payload: memoryview, obj: MemoryObj) -> None:
    spec.verify_payload(header, payload)
    spec.decode_into(header, payload, obj.tensor)
