"""Write-behind into the slow tiers: one writer task per tier, fed by a bounded queue.

A store hands its chunks to each slow tier's :class:`TierWriter` and returns; the writer
puts them into the tier in the background. A full queue skips that tier's write and counts
it (back-pressure must not reach a store through a slow disk or a far Redis), and so does a
tier that is down when the write comes up. A write's KV event is recorded once the tier
added something. Everything here runs on the event loop.

Erasing a tenant: :meth:`TierWriter.forget` drops the tenant's chunks from the queued
writes at once; :meth:`TierWriter.settle` waits for a write of the tenant under way, so the
tier's own erasure comes after it; a write the erasure stopped waiting for is
:meth:`TierWriter.abandon`-ed: it removes the tenant's chunks it put once it ends. And each
write carries the erasure mark of the store or read its payloads came from
(:mod:`.epochs`): when it comes up, the chunks of a tenant erased since (or being erased)
are dropped, so a write handed over during an erasure, or by a store reserved before it,
never lands either. Nothing queued before an erasure stays in the tier after it.

Removals: given ``removed``, a writer becomes its tier's removal listener and passes on
the keys the tier reports gone, except those of a write under way whose stored event is
still to come (a chunk the write's own put evicted, refused or undid): those are passed on
after that event, so a router never sees a chunk stored after it was removed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj
from lmcache_async.tenancy.tenants import TAG_BYTES

from ..errors import TierError
from ..events import EventBuffer, PendingEvent
from .base import RemovalListener, StorageBackend
from .epochs import ErasureEpochs

__all__ = ["TierWriter", "TierWriters"]

log = get_logger(__name__)


@dataclass(slots=True, eq=False)
class _Write:
    keys: list[ChunkKey]
    objs: list[MemoryObj]  # one reference each when queued, owned by the write
    event: PendingEvent | None
    since: int = 0
    """The erasure mark of the store or read the payloads came from."""
    ended: anyio.Event | None = None
    """Set when the write is done, for an erasure waiting on it (made on demand)."""
    undo: frozenset[bytes] = frozenset()
    """Tags of tenants erased while the write was under way: removed once it ends."""
    lost: list[ChunkKey] | None = None
    """Keys of the write the tier reported removed while it was under way."""

    def has_tag(self, tag: bytes) -> bool:
        return any(key[:TAG_BYTES] == tag for key in self.keys)

    def drop_tag(self, tag: bytes) -> int:
        """Forget (and release) the chunks of ``tag``; returns how many there were."""
        ours = [key[:TAG_BYTES] == tag for key in self.keys]
        dropped = sum(ours)
        if dropped:
            _release([obj for obj, mine in zip(self.objs, ours, strict=True) if mine])
            self.keys = [key for key, mine in zip(self.keys, ours, strict=True) if not mine]
            self.objs = [obj for obj, mine in zip(self.objs, ours, strict=True) if not mine]
            self.event = None  # it names chunks no longer written
        return dropped


def _release(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.unref()


class TierWriter:
    """Writes chunks behind the stores into one slow tier, through a bounded queue.

    ``epochs``: the erasure epochs a write's mark is checked against when it comes up
    (None: a private set, for a writer used alone). ``removed``: told the keys that left
    the tier, the writer being the tier's removal listener (None: the tier's listener is
    left as it is).
    """

    def __init__(
        self,
        tier: StorageBackend,
        *,
        queue_size: int,
        events: EventBuffer,
        epochs: ErasureEpochs | None = None,
        removed: RemovalListener | None = None,
    ) -> None:
        self.tier = tier
        self._removed = removed
        if removed is not None:
            tier.set_removal_listener(self._tier_removed)
        self._events = events
        self._epochs = epochs if epochs is not None else ErasureEpochs()
        self._send: MemoryObjectSendStream[_Write]
        self._receive: MemoryObjectReceiveStream[_Write]
        self._send, self._receive = anyio.create_memory_object_stream[_Write](queue_size)
        self.pending = 0
        self.dropped = 0
        self.written = 0
        self.failed = 0
        self.erased = 0
        """Chunks dropped from queued writes, or removed after a write, by erasures."""
        self._idle = anyio.Event()
        self._idle.set()
        self._queued: set[_Write] = set()
        self._running: set[_Write] = set()

    def submit(
        self,
        keys: list[ChunkKey],
        objs: Sequence[MemoryObj],
        event: PendingEvent | None,
        *,
        since: int | None = None,
    ) -> bool:
        """Queue a write (taking references); False when the queue is full or closed.
        ``since``: the erasure mark of the payloads' store or read (None: now)."""
        mark = self._epochs.mark() if since is None else since
        write = _Write(keys, [obj.ref() for obj in objs], event, mark)
        try:
            self._send.send_nowait(write)
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            _release(write.objs)
            self.dropped += len(keys)
            return False
        self._queued.add(write)
        self.pending += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        return True

    async def write(
        self,
        keys: list[ChunkKey],
        objs: Sequence[MemoryObj],
        event: PendingEvent | None,
        *,
        since: int | None = None,
    ) -> int:
        """Write now and wait for it; returns the chunks written (0 on failure, or when
        every chunk is of a tenant erased since the mark ``since``; None: now)."""
        mark = self._epochs.mark() if since is None else since
        write = _Write(keys, list(objs), event, mark)
        held = [obj.ref() for obj in write.objs]  # drop_tag releases what it drops
        write.objs = held
        try:
            self._drop_erased(write)
            if not write.keys:
                return 0
            return await self._put(write)
        finally:
            _release(write.objs)

    def _drop_erased(self, write: _Write) -> int:
        """Drop from ``write`` the chunks of tenants erased since its mark (or being
        erased); returns how many were dropped. Call right before the tier's put."""
        epochs = self._epochs
        if epochs.intact(write.keys, write.since) == len(write.keys):
            return 0
        erased = {key[:TAG_BYTES] for key in write.keys if epochs.erased_since(key, write.since)}
        dropped = sum(write.drop_tag(tag) for tag in erased)
        self.erased += dropped
        return dropped

    async def _put(self, write: _Write) -> int:
        self._running.add(write)
        try:
            return await self._put_running(write)
        finally:
            self._running.discard(write)
            if write.lost and self._removed is not None:
                self._removed(write.lost)  # after the write's stored event, if any
            if write.ended is not None:
                write.ended.set()

    def _tier_removed(self, keys: Sequence[ChunkKey]) -> None:
        """The tier's removal listener: ``keys`` are passed on now, but those of a write
        under way with a stored event still to record, kept for after it."""
        now = list(keys)
        for write in self._running:
            if write.event is not None and now:
                mine = set(write.keys)
                held = [key for key in now if key in mine]
                if held:
                    write.lost = [*(write.lost or ()), *held]
                    now = [key for key in now if key not in mine]
        if now and self._removed is not None:
            self._removed(now)

    async def _put_running(self, write: _Write) -> int:
        keys = write.keys
        try:
            added = await self.tier.put(keys, write.objs)
        except TierError as exc:
            self.failed += len(keys)
            log.warning("tier_write_failed", tier=self.tier.name, chunks=len(keys), error=str(exc))
            return 0
        except Exception:
            self.failed += len(keys)
            log.exception("tier_write_failed", tier=self.tier.name, chunks=len(keys))
            return 0
        if write.undo and await self._undo(write):
            return 0
        self.written += len(keys)
        if added and write.event is not None:
            self._events.add(write.event)
        return len(keys)

    async def _undo(self, write: _Write) -> bool:
        """Remove what ``write`` put of tenants erased while it was under way; True when
        that was all of it."""
        gone = [key for key in write.keys if key[:TAG_BYTES] in write.undo]
        if not gone:
            return False
        try:
            await self.tier.remove(gone)
        except Exception as exc:
            log.error(
                "tier_erase_after_write_failed",
                tier=self.tier.name,
                chunks=len(gone),
                error=str(exc),
            )
        else:
            self.erased += len(gone)
        return len(gone) == len(write.keys)

    async def run(self) -> None:
        """Drain the queue until it is closed; every write's references are released."""
        async with self._receive:
            async for item in self._receive:
                self._queued.discard(item)
                try:
                    self._drop_erased(item)
                    if not item.keys:
                        pass  # erased while queued
                    elif self.tier.healthy():
                        await self._put(item)
                    else:
                        self.dropped += len(item.keys)
                finally:
                    _release(item.objs)
                    self.pending -= 1
                    if self.pending == 0:
                        self._idle.set()

    def forget(self, tag: bytes) -> int:
        """Drop the chunks of the tenant with ``tag`` from every queued write (releasing
        them); returns how many were dropped."""
        dropped = sum(write.drop_tag(tag) for write in self._queued)
        self.erased += dropped
        return dropped

    def abandon(self, tag: bytes) -> None:
        """Make each write of the tenant with ``tag`` under way now remove the tenant's
        chunks it put once it ends (an erasure that could not wait for it)."""
        for write in self._running:
            if write.has_tag(tag):
                write.undo |= {tag}

    async def settle(self, tag: bytes) -> None:
        """Wait until no write holding chunks of ``tag`` is under way (bound it with a
        cancel scope)."""
        while True:
            busy = next((write for write in self._running if write.has_tag(tag)), None)
            if busy is None:
                return
            if busy.ended is None:
                busy.ended = anyio.Event()
            await busy.ended.wait()

    async def drain(self) -> None:
        """Wait until every queued write is done."""
        while self.pending:
            await self._idle.wait()

    def close(self) -> None:
        self._send.close()

    def discard(self) -> None:
        """Drop queued writes without writing them (after close, when time ran out)."""
        while True:
            try:
                item = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            self._queued.discard(item)
            _release(item.objs)
            self.dropped += len(item.keys)
            self.pending -= 1


class TierWriters(Mapping[str, TierWriter]):
    """The writers of a set of slow tiers, by tier name, and what they do together."""

    def __init__(
        self,
        tiers: Sequence[StorageBackend],
        *,
        queue_size: int,
        events: EventBuffer,
        epochs: ErasureEpochs | None = None,
        removed: Callable[[str, Sequence[ChunkKey]], None] | None = None,
    ) -> None:
        """``removed(tier name, keys)``: told the keys that left each tier (see
        :class:`TierWriter`; None: the tiers' listeners are left as they are)."""
        self._writers = {
            tier.name: TierWriter(
                tier,
                queue_size=queue_size,
                events=events,
                epochs=epochs,
                removed=None if removed is None else functools.partial(removed, tier.name),
            )
            for tier in tiers
        }

    def __getitem__(self, name: str) -> TierWriter:
        return self._writers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._writers)

    def __len__(self) -> int:
        return len(self._writers)

    def start(self, task_group: TaskGroup) -> None:
        """Start each writer's task in ``task_group``."""
        for writer in self._writers.values():
            task_group.start_soon(writer.run, name=f"tier-writer-{writer.tier.name}")

    async def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every queued write is done; False when
        time ran out first."""
        with anyio.move_on_after(timeout):
            for writer in self._writers.values():
                await writer.drain()
            return True
        return False

    def close(self) -> None:
        """Take no more writes (queued ones are still written)."""
        for writer in self._writers.values():
            writer.close()

    def discard(self) -> None:
        """Drop every queued write (after :meth:`close`, when time ran out)."""
        for writer in self._writers.values():
            writer.discard()

    @property
    def pending(self) -> int:
        return sum(writer.pending for writer in self._writers.values())

    @property
    def dropped(self) -> int:
        return sum(writer.dropped for writer in self._writers.values())

    @property
    def failed(self) -> int:
        return sum(writer.failed for writer in self._writers.values())
