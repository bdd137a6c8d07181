"""Write-behind into the slow tiers: one writer task per tier, fed by a bounded queue.

A store hands its chunks to each slow tier's :class:`TierWriter` and returns; the writer
puts them into the tier in the background. A full queue skips that tier's write and counts
it (back-pressure must not reach a store through a slow disk or a far Redis), and so does a
tier that is down when the write comes up. A write's KV event is recorded once the tier
added something. Everything here runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import TierError
from ..events import EventBuffer, KVEvent
from ..keys import ChunkKey
from ..memory import MemoryObj
from .base import StorageBackend

__all__ = ["TierWriter", "TierWriters"]

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Write:
    keys: list[ChunkKey]
    objs: list[MemoryObj]  # one reference each, owned by the write
    event: KVEvent | None


def _release(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.unref()


class TierWriter:
    """Writes chunks behind the stores into one slow tier, through a bounded queue."""

    def __init__(self, tier: StorageBackend, *, queue_size: int, events: EventBuffer) -> None:
        self.tier = tier
        self._events = events
        self._send: MemoryObjectSendStream[_Write]
        self._receive: MemoryObjectReceiveStream[_Write]
        self._send, self._receive = anyio.create_memory_object_stream[_Write](queue_size)
        self.pending = 0
        self.dropped = 0
        self.written = 0
        self.failed = 0
        self._idle = anyio.Event()
        self._idle.set()

    def submit(
        self, keys: list[ChunkKey], objs: Sequence[MemoryObj], event: KVEvent | None
    ) -> bool:
        """Queue a write (taking references); False when the queue is full or closed."""
        write = _Write(keys, [obj.ref() for obj in objs], event)
        try:
            self._send.send_nowait(write)
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            _release(write.objs)
            self.dropped += len(keys)
            return False
        self.pending += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        return True

    async def write(
        self, keys: list[ChunkKey], objs: Sequence[MemoryObj], event: KVEvent | None
    ) -> int:
        """Write now and wait for it; returns the chunks written (0 on failure)."""
        try:
            added = await self.tier.put(keys, objs)
        except TierError as exc:
            self.failed += len(keys)
            log.warning("tier_write_failed", tier=self.tier.name, chunks=len(keys), error=str(exc))
            return 0
        except Exception:
            self.failed += len(keys)
            log.exception("tier_write_failed", tier=self.tier.name, chunks=len(keys))
            return 0
        self.written += len(keys)
        if added and event is not None:
            self._events.add(event)
        return len(keys)

    async def run(self) -> None:
        """Drain the queue until it is closed; every write's references are released."""
        async with self._receive:
            async for item in self._receive:
                try:
                    if self.tier.healthy():
                        await self.write(item.keys, item.objs, item.event)
                    else:
                        self.dropped += len(item.keys)
                finally:
                    _release(item.objs)
                    self.pending -= 1
                    if self.pending == 0:
                        self._idle.set()

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
                return
            _release(item.objs)
            self.dropped += len(item.keys)
            self.pending -= 1


class TierWriters(Mapping[str, TierWriter]):
    """The writers of a set of slow tiers, by tier name, and what they do together."""

    def __init__(
        self, tiers: Sequence[StorageBackend], *, queue_size: int, events: EventBuffer
    ) -> None:
        self._writers = {
            tier.name: TierWriter(tier, queue_size=queue_size, events=events) for tier in tiers
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
