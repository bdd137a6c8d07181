"""The storage manager: one front for the tiers, with pins, freeze and the hot-cache switch.

The CPU tier is the hot cache; slow tiers (disk, Redis) sit behind it. A store puts chunks
into the CPU tier at once and hands them to each slow tier's writer through a bounded queue
(write-behind: a full queue skips that tier's write and counts it), or waits for the slow
tiers when configured to. A lookup counts a prefix across tiers (it may begin on CPU and
continue on disk or in Redis); a fetch reads the chunks the CPU tier lacks from the slow
tiers and promotes them into it. A slow tier that is down is skipped, never waited on; a
failing call is a miss. The manager decides what a write goes to and what a read comes
from; it knows nothing of pipelines or requests. Everything here runs on the event loop;
no method blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import InvalidInputError, TierError
from ..events import EventBuffer, EventKind, KVEvent
from ..keys import ChunkKey, ChunkSpan
from ..memory import MemoryObj
from ..stats import TierStats
from .base import StorageBackend
from .cpu import CPUBackend

__all__ = ["StorageManager", "chunk_keys"]

log = structlog.get_logger(__name__)

Clock = Callable[[], float]


@dataclass(slots=True)
class _PinSet:
    objs: list[MemoryObj]
    deadline: float
    # Prefetched payloads by key, for a retrieve under the same lookup id (they may not be
    # in the CPU tier when the hot cache is off).
    by_key: dict[bytes, MemoryObj] = field(default_factory=dict)


@dataclass(slots=True)
class _Write:
    keys: list[ChunkKey]
    objs: list[MemoryObj]  # one reference each, owned by the write
    event: KVEvent | None


class _TierWriter:
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


def chunk_keys(keys: Sequence[bytes]) -> list[ChunkKey]:
    """Keys as :class:`ChunkKey` (a lookup may probe with bare whole-chunk digests)."""
    return [key if isinstance(key, ChunkKey) else ChunkKey(key) for key in keys]


def _release(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.unref()


TIER_ORDER = ("cpu", "disk", "redis")


class StorageManager:
    """Routes reads and writes to the tiers and keeps lookup pins.

    ``slow_tiers``: disk / Redis backends, fastest first. ``store_location`` and
    ``retrieve_locations`` name the tiers writes go to and reads come from (None: all).
    ``pin_timeout``: seconds after which pins a caller never released are released anyway.
    ``wait_for_slow_tiers``: stores wait for the slow tiers instead of writing behind.
    """

    def __init__(
        self,
        cpu: CPUBackend,
        *,
        events: EventBuffer,
        chunk_size: int,
        pin_timeout: float,
        hot_cache: bool = True,
        slow_tiers: Sequence[StorageBackend] = (),
        store_location: Sequence[str] | None = None,
        retrieve_locations: Sequence[str] | None = None,
        write_queue_size: int = 64,
        wait_for_slow_tiers: bool = False,
        clock: Clock = time.monotonic,
    ) -> None:
        self._cpu = cpu
        self._events = events
        self._chunk_size = chunk_size
        self._pin_timeout = pin_timeout
        self._clock = clock
        self._pins: dict[Hashable, _PinSet] = {}
        self._frozen = False
        self._hot_cache = hot_cache
        self._want_store = None if store_location is None else tuple(store_location)
        self._want_read = None if retrieve_locations is None else tuple(retrieve_locations)
        self._write_queue_size = write_queue_size
        self._wait_for_slow = wait_for_slow_tiers
        self._slow: list[StorageBackend] = []
        self._tiers: dict[str, StorageBackend] = {}
        self._writers: dict[str, _TierWriter] = {}
        self._store_to: tuple[str, ...] = ()
        self._read_from: tuple[str, ...] = ()
        self.attach_slow_tiers(slow_tiers)
        self.expired_pins = 0
        self.promoted_chunks = 0
        self.tier_read_errors = 0

    def attach_slow_tiers(self, tiers: Sequence[StorageBackend]) -> None:
        """Put ``tiers`` (fastest first) behind the CPU tier; call before :meth:`start`.

        The configured store and retrieve locations are narrowed to the enabled tiers.
        """
        self._slow = list(tiers)
        self._tiers = {self._cpu.name: self._cpu}
        self._tiers.update((tier.name, tier) for tier in self._slow)
        self._writers = {
            tier.name: _TierWriter(tier, queue_size=self._write_queue_size, events=self._events)
            for tier in self._slow
        }
        self._store_to = self._enabled(self._want_store)
        self._read_from = self._enabled(self._want_read)

    def _enabled(self, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
        return tuple(
            name
            for name in TIER_ORDER
            if name in self._tiers and (wanted is None or name in wanted)
        )

    def check_locations(self, locations: Sequence[str] | None, name: str) -> tuple[str, ...]:
        """The enabled tiers among ``locations`` (all enabled tiers for None), in tier order.

        Raises:
            InvalidInputError: a location names no enabled tier.
        """
        if locations is None:
            return tuple(self._tiers)
        if isinstance(locations, str):
            locations = [locations]
        for location in locations:
            if location not in self._tiers:
                raise InvalidInputError(
                    f"{name}: {location!r} is not an enabled tier (enabled: {list(self._tiers)})"
                )
        return tuple(tier for tier in TIER_ORDER if tier in locations)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(self._tiers)

    def tier(self, name: str) -> StorageBackend:
        """The enabled tier called ``name``. Raises InvalidInputError for another name."""
        self.check_locations([name], "location")
        return self._tiers[name]

    @property
    def slow_tiers(self) -> list[StorageBackend]:
        return list(self._slow)

    async def start(self, task_group: TaskGroup) -> None:
        """Start a writer task per slow tier in ``task_group``."""
        for writer in self._writers.values():
            task_group.start_soon(writer.run, name=f"tier-writer-{writer.tier.name}")

    # -- switches -------------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        return self._frozen

    def freeze(self, enabled: bool) -> None:
        """In freeze mode nothing is written; reads are served from the CPU tier only."""
        self._frozen = enabled
        log.info("freeze_mode", enabled=enabled)

    @property
    def hot_cache(self) -> bool:
        return self._hot_cache

    def set_hot_cache(self, enabled: bool) -> None:
        """With the hot cache off the CPU tier keeps nothing new (what it has stays)."""
        self._hot_cache = enabled
        log.info("hot_cache", enabled=enabled)

    @property
    def accepts_writes(self) -> bool:
        """Whether a store can keep anything now (some target tier takes writes)."""
        if self._frozen:
            return False
        return (self._hot_cache and self._cpu.name in self._store_to) or any(
            tier.name in self._store_to and tier.healthy() for tier in self._slow
        )

    def _cpu_writable(self, locations: tuple[str, ...]) -> bool:
        return self._hot_cache and not self._frozen and self._cpu.name in locations

    def _readable(self, locations: Sequence[str] | None) -> list[StorageBackend]:
        """Slow tiers a read may use now: named, enabled, healthy, and not frozen."""
        if self._frozen or not self._slow:
            return []
        names = self._read_from if locations is None else locations
        return [tier for tier in self._slow if tier.name in names and tier.healthy()]

    # -- reads ----------------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys in the CPU tier (a bare digest finds its whole-chunk key)."""
        if self._cpu.name not in self._read_from:
            return 0
        return self._cpu.contains_prefix_nowait(keys)

    async def lookup_prefix(
        self, keys: Sequence[bytes], locations: Sequence[str] | None = None
    ) -> int:
        """Number of leading keys held across the readable tiers.

        The run may begin in one tier and continue in another. A slow tier that fails is
        skipped (a miss), never raised.
        """
        names = self._read_from if locations is None else locations
        hits = self._cpu.contains_prefix_nowait(keys) if self._cpu.name in names else 0
        if hits == len(keys):
            return hits
        tiers = self._readable(names)
        progressed = True
        while progressed and hits < len(keys):
            progressed = False
            if hits and self._cpu.name in names:
                more = self._cpu.contains_prefix_nowait(keys[hits:])
                hits += more
            for tier in tiers:
                if hits == len(keys):
                    break
                try:
                    more = await tier.contains_prefix(chunk_keys(keys[hits:]))
                except TierError as exc:
                    self._read_failed(tier, exc)
                    continue
                if more:
                    hits += more
                    progressed = True
        return hits

    def contains(self, key: ChunkKey) -> bool:
        return key in self._cpu

    def hold(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """The payload of each key in the CPU tier, referenced for the caller."""
        return self._cpu.get_nowait(keys)

    def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """Payloads of the leading keys in the CPU tier, each referenced for the caller."""
        return self._cpu.get_prefix_nowait(keys)

    async def fetch_prefix(
        self,
        keys: Sequence[ChunkKey],
        locations: Sequence[str] | None = None,
        lookup_id: Hashable | None = None,
    ) -> list[MemoryObj]:
        """Payloads of the leading keys held anywhere, each referenced for the caller.

        Chunks prefetched for ``lookup_id`` come first, then the CPU tier, then the slow
        tiers; what a slow tier returns is promoted into the CPU tier (hot cache on).
        """
        names = self._read_from if locations is None else tuple(locations)
        pinned = self._pins.get(lookup_id) if lookup_id is not None else None
        out: list[MemoryObj] = []
        tiers = self._readable(names)
        while len(out) < len(keys):
            before = len(out)
            if pinned is not None:
                for key in keys[len(out) :]:
                    obj = pinned.by_key.get(key)
                    if obj is None or obj.freed:
                        break
                    out.append(obj.ref())
            if self._cpu.name in names:
                out.extend(self._cpu.get_prefix_nowait(keys[len(out) :]))
            for tier in tiers:
                if len(out) == len(keys):
                    break
                out.extend(await self._read_slow(tier, keys[len(out) :], names))
            if len(out) == before:
                break
        return out

    async def _read_slow(
        self, tier: StorageBackend, keys: Sequence[ChunkKey], names: Sequence[str]
    ) -> list[MemoryObj]:
        """The leading run of ``keys`` ``tier`` returns, promoted into the CPU tier."""
        try:
            got = await tier.get(keys)
        except TierError as exc:
            self._read_failed(tier, exc)
            return []
        run: list[MemoryObj] = []
        for obj in got:
            if obj is None:
                break
            run.append(obj)
        for obj in got[len(run) :]:
            if obj is not None:
                obj.unref()
        if run and self._cpu_writable(tuple(names) if self._cpu.name in names else ()):
            self.promoted_chunks += self._cpu.put_nowait(list(keys[: len(run)]), run)
        return run

    def _read_failed(self, tier: StorageBackend, exc: Exception) -> None:
        self.tier_read_errors += 1
        log.warning("tier_read_failed", tier=tier.name, error=str(exc))

    # -- writes ---------------------------------------------------------------------------

    async def put(
        self,
        spans: Sequence[ChunkSpan],
        objs: Sequence[MemoryObj],
        tokens: np.ndarray | None,
        locations: Sequence[str] | None = None,
    ) -> int:
        """Cache payloads for ``spans``; returns how many chunks a tier took or queued.

        ``tokens`` (the request's tokens, or None when keys came from engine block hashes)
        fill the KV events. Nothing is written when frozen; the CPU tier keeps nothing new
        with the hot cache off.
        """
        if self._frozen or not spans:
            return 0
        targets = self._store_to if locations is None else tuple(locations)
        keys = [span.key for span in spans]
        kept = 0
        if self._cpu_writable(targets):
            if self._cpu.put_nowait(keys, objs):
                self._events.add(self._stored_event(spans, tokens, self._cpu.name))
            kept = len(keys)
        for tier in self._slow:
            if tier.name not in targets or not tier.healthy():
                continue
            writer = self._writers[tier.name]
            event = self._stored_event(spans, tokens, tier.name)
            if self._wait_for_slow:
                kept = max(kept, await writer.write(keys, objs, event))
            elif writer.submit(keys, objs, event):
                kept = len(keys)
        return kept

    def _stored_event(
        self, spans: Sequence[ChunkSpan], tokens: np.ndarray | None, medium: str
    ) -> KVEvent:
        token_ids: tuple[int, ...] = ()
        if tokens is not None:
            token_ids = tuple(tokens[spans[0].start : spans[-1].end].tolist())
        return KVEvent(
            kind=EventKind.STORED,
            block_hashes=tuple(span.key.digest for span in spans),
            parent_block_hash=spans[0].parent.digest if spans[0].parent else None,
            token_ids=token_ids,
            block_size=self._chunk_size,
            medium=medium,
        )

    async def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until queued slow-tier writes are done."""
        with anyio.move_on_after(timeout):
            for writer in self._writers.values():
                await writer.drain()
            return True
        return False

    def on_evicted(self, keys: list[ChunkKey]) -> None:
        """Record chunks the CPU tier dropped (eviction listener)."""
        self._removed_event(keys, self._cpu.name)

    async def remove(self, keys: Sequence[ChunkKey], locations: Sequence[str] | None = None) -> int:
        """Forget ``keys`` in the named tiers (all by default); returns chunks removed."""
        names = self.check_locations(locations, "locations")
        removed = 0
        if self._cpu.name in names:
            present = [key for key in keys if key in self._cpu]
            removed += self._cpu.remove_nowait(present)
            self._removed_event(present, self._cpu.name)
        for tier in self._slow:
            if tier.name in names and tier.healthy():
                try:
                    gone = await tier.remove(keys)
                except TierError as exc:
                    self._read_failed(tier, exc)
                    continue
                removed += gone
                if gone:
                    self._removed_event(keys, tier.name)
        return removed

    async def clear(self, locations: Sequence[str] | None = None) -> int:
        """Drop every chunk of the named tiers (all by default) and, for the CPU tier, every
        pin; returns the number of chunks dropped."""
        names = self.check_locations(locations, "locations")
        dropped = 0
        if self._cpu.name in names:
            self.release_all_pins()
            keys = self._cpu.clear_nowait()
            self._removed_event(keys, self._cpu.name)
            dropped += len(keys)
        for tier in self._slow:
            if tier.name in names:
                await self._writers[tier.name].drain()
                try:
                    dropped += await tier.clear()
                except TierError as exc:
                    self._read_failed(tier, exc)
        log.info("cache_cleared", chunks=dropped, locations=list(names))
        return dropped

    def _removed_event(self, keys: Sequence[ChunkKey], medium: str) -> None:
        if keys:
            self._events.add(
                KVEvent(
                    kind=EventKind.REMOVED,
                    block_hashes=tuple(key.digest for key in keys),
                    parent_block_hash=None,
                    token_ids=(),
                    block_size=self._chunk_size,
                    medium=medium,
                )
            )

    # -- pins -----------------------------------------------------------------------------

    def pin_prefix(self, keys: Sequence[bytes], lookup_id: Hashable) -> int:
        """Pin the leading CPU-tier keys for ``lookup_id``; returns how many were pinned.

        Pinning again under the same id replaces the earlier pins.
        """
        self.unpin(lookup_id)
        if self._cpu.name not in self._read_from:
            return 0
        objs = self._cpu.pin_prefix_nowait(keys)
        if objs:
            self._pins[lookup_id] = _PinSet(objs, self._clock() + self._pin_timeout)
        return len(objs)

    def pin_objects(
        self, keys: Sequence[bytes], objs: Sequence[MemoryObj], lookup_id: Hashable
    ) -> None:
        """Reference and pin prefetched ``objs`` for ``lookup_id``; a retrieve under that id
        is served from them."""
        self.unpin(lookup_id)
        held = [obj.ref() for obj in objs]
        for obj in held:
            obj.pin()
        self._pins[lookup_id] = _PinSet(
            held, self._clock() + self._pin_timeout, dict(zip(keys, held, strict=False))
        )

    def unpin(self, lookup_id: Hashable) -> int:
        """Release the pins of ``lookup_id``; returns how many chunks were released."""
        pins = self._pins.pop(lookup_id, None)
        if pins is None:
            return 0
        for obj in pins.objs:
            obj.unpin()
            obj.unref()
        return len(pins.objs)

    def release_all_pins(self) -> int:
        return sum(self.unpin(lookup_id) for lookup_id in list(self._pins))

    def expire_pins(self) -> int:
        """Release pins whose deadline has passed; returns how many lookup ids expired."""
        now = self._clock()
        expired = [lid for lid, pins in self._pins.items() if pins.deadline <= now]
        for lookup_id in expired:
            chunks = self.unpin(lookup_id)
            log.warning("lookup_pins_expired", lookup_id=str(lookup_id), chunks=chunks)
        self.expired_pins += len(expired)
        return len(expired)

    def next_pin_deadline(self) -> float | None:
        if not self._pins:
            return None
        return min(pins.deadline for pins in self._pins.values())

    @property
    def pinned_chunks(self) -> int:
        return sum(len(pins.objs) for pins in self._pins.values())

    @property
    def active_lookup_ids(self) -> int:
        return len(self._pins)

    # -- state ----------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, TierStats]:
        return {name: tier.stats() for name, tier in self._tiers.items()}

    def tier_health(self) -> dict[str, bool]:
        return {name: tier.healthy() for name, tier in self._tiers.items()}

    @property
    def tier_writes_pending(self) -> int:
        return sum(writer.pending for writer in self._writers.values())

    @property
    def tier_writes_dropped(self) -> int:
        return sum(writer.dropped for writer in self._writers.values())

    @property
    def tier_writes_failed(self) -> int:
        return sum(writer.failed for writer in self._writers.values())

    def healthy(self) -> bool:
        """The engine can serve while its CPU tier can: slow tiers down are bypassed."""
        return self._cpu.healthy()

    async def aclose(self, drain_timeout: float = math.inf) -> None:
        """Finish queued slow-tier writes (bounded), then release everything."""
        for writer in self._writers.values():
            writer.close()
        if not await self.flush(drain_timeout):
            log.warning("tier_writes_abandoned", pending=self.tier_writes_pending)
        for writer in self._writers.values():
            writer.discard()
        self.release_all_pins()
        for tier in self._slow:
            try:
                await tier.aclose()
            except Exception:
                log.exception("tier_close_failed", tier=tier.name)
        await self._cpu.aclose()
