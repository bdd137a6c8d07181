"""The storage manager: one front for the tiers, with pins, freeze and the hot-cache switch.

The CPU tier is the hot cache; slow tiers (disk, Redis) sit behind it. A store puts chunks
into the CPU tier at once and hands them to each slow tier's writer through a bounded queue
(write-behind, :mod:`.writers`: a full queue skips that tier's write and counts it), or
waits for the slow tiers when configured to. Erasure by tenant reaches every tier and the
queued writes, and it is final: work that read or reserved a tenant's payloads before an
erasure of it (a store's commit, a promotion, a prefetch's pins, a write behind) lands
nothing after it (:mod:`.epochs`). A lookup counts a prefix across tiers (it may begin on
CPU and continue on disk or in Redis); a fetch reads the chunks the CPU tier lacks from the
slow tiers and promotes them into it. A slow tier that is down is skipped, never waited
on; a failing call is a miss. The manager decides what a write goes to and what a read
comes from (the enabled tiers and locations: :mod:`.tiers`); it knows nothing of pipelines
or requests. Lookup pins are kept in :mod:`.pins` (counted against the tenants' CPU
quotas, :mod:`.manager_pins`), KV events built in :mod:`.tier_events`. Everything here
runs on the event loop; no method blocks.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Hashable, Sequence

import numpy as np
from anyio.abc import TaskGroup

from lmcache_async.keys.chunks import ChunkKey, ChunkSpan
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj

from ..errors import InvalidInputError
from ..events import EventBuffer
from ..stats import TierStats
from .admission import Admission
from .base import StorageBackend
from .cpu import CPUBackend
from .epochs import ErasureEpochs
from .manager_admission import HeldWrites
from .manager_pins import LookupPins
from .manager_removals import Removals
from .pins import Clock, PinSets
from .prefix import OnRead, chunk_keys, count_prefix, read_prefix
from .removal_events import RemovalEvents
from .tier_events import TierEvents
from .tiers import TierSet
from .writers import TierWriters

__all__ = ["StorageManager", "chunk_keys"]

log = get_logger(__name__)


def _check_count(name: str, value: object, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise InvalidInputError(f"{name} must be an int from 0 to {most}, got {value!r}")


class StorageManager(LookupPins, HeldWrites, Removals):
    """Routes reads and writes to the tiers and keeps lookup pins.

    ``slow_tiers``: disk / Redis backends, fastest first. ``store_location`` and
    ``retrieve_locations`` name the tiers writes go to and reads come from (None: all).
    ``pin_timeout``: seconds after which pins a caller never released are released anyway.
    ``wait_for_slow_tiers``: stores wait for the slow tiers instead of writing behind.
    ``admission``: which stored chunks go to the slow tiers at once (``store_threshold``;
    None: all of them).
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
        admission: Admission | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._cpu = cpu
        self._events = events
        self._kv_events = TierEvents(events, chunk_size=chunk_size)
        self._epochs = ErasureEpochs()
        self._pins = PinSets(timeout=pin_timeout, clock=clock, on_release=cpu.release_pins)
        self._frozen = False
        self._hot_cache = hot_cache
        self._want_store = None if store_location is None else tuple(store_location)
        self._want_read = None if retrieve_locations is None else tuple(retrieve_locations)
        self._write_queue_size = write_queue_size
        self._wait_for_slow = wait_for_slow_tiers
        self._admission = admission
        self._tiers = TierSet(cpu)
        self._writers = TierWriters(
            (), queue_size=write_queue_size, events=events, epochs=self._epochs
        )
        self._removal_events = RemovalEvents(self._kv_events)
        self.attach_slow_tiers(slow_tiers)
        self.promoted_chunks = 0
        self.tier_read_errors = 0
        self._read_observer: OnRead | None = None

    def attach_slow_tiers(self, tiers: Sequence[StorageBackend]) -> None:
        """Put ``tiers`` (fastest first) behind the CPU tier; call before :meth:`start`.

        The configured store and retrieve locations are narrowed to the enabled tiers.
        Each tier's removal listener is set to record removed KV events (through its
        writer, :mod:`.writers`; :mod:`.removal_events`).
        """
        self._tiers = TierSet(
            self._cpu, tiers, wanted_store=self._want_store, wanted_read=self._want_read
        )
        self._writers = TierWriters(
            self._tiers.slow,
            queue_size=self._write_queue_size,
            events=self._events,
            epochs=self._epochs,
            removed=self._removal_events.record,
        )

    def check_locations(self, locations: Sequence[str] | None, name: str) -> tuple[str, ...]:
        """The enabled tiers among ``locations`` (all enabled tiers for None), in tier order.

        Raises:
            InvalidInputError: a location names no enabled tier.
        """
        return self._tiers.check_locations(locations, name)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return self._tiers.names

    def tier(self, name: str) -> StorageBackend:
        """The enabled tier called ``name``. Raises InvalidInputError for another name."""
        return self._tiers.tier(name)

    @property
    def slow_tiers(self) -> list[StorageBackend]:
        return list(self._tiers.slow)

    def reads_slow_tiers(self, locations: Sequence[str] | None) -> bool:
        """Whether a read from ``locations`` (None: the configured ones) may reach a slow
        tier: some slow tier is attached and the locations are not the CPU tier alone."""
        return bool(self._tiers.slow) and (
            locations is None or any(name != "cpu" for name in locations)
        )

    async def start(self, task_group: TaskGroup) -> None:
        """Start a writer task per slow tier in ``task_group``."""
        self._writers.start(task_group)

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
        store_to = self._tiers.store_to
        return (self._hot_cache and self._cpu.name in store_to) or any(
            tier.name in store_to and tier.healthy() for tier in self._tiers.slow
        )

    def _cpu_writable(self, locations: tuple[str, ...]) -> bool:
        return self._hot_cache and not self._frozen and self._cpu.name in locations

    def puts_at_once(self, locations: Sequence[str] | None) -> bool:
        """Whether a :meth:`put` into ``locations`` (None: the configured ones) counts
        every chunk it is given as kept without waiting for any tier: the CPU tier takes
        them, and no slow-tier write is waited for. Only an erasure of their tenant before
        the put comes can then keep fewer."""
        targets = self._tiers.store_to if locations is None else tuple(locations)
        if not self._cpu_writable(targets):
            return False
        return not self._wait_for_slow or not any(t.name in targets for t in self._tiers.slow)

    def _readable(self, locations: Sequence[str] | None) -> list[StorageBackend]:
        """Slow tiers a read may use now: named, enabled, healthy, and not frozen."""
        if self._frozen or not self._tiers.slow:
            return []
        return self._tiers.readable(self._tiers.read_from if locations is None else locations)

    # -- reads ----------------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys in the CPU tier (a bare digest finds its whole-chunk key)."""
        if self._cpu.name not in self._tiers.read_from:
            return 0
        return self._cpu.contains_prefix_nowait(keys)

    async def lookup_prefix(
        self,
        keys: Sequence[bytes],
        locations: Sequence[str] | None = None,
        *,
        cpu_hits: int | None = None,
    ) -> int:
        """Number of leading keys held across the readable tiers.

        The run may begin in one tier and continue in another: each tier is asked from
        where the others have got to, never again where it stopped itself
        (:mod:`.prefix`). A slow tier that fails is skipped (a miss), never raised.

        ``cpu_hits``: the number of leading ``keys`` the CPU tier holds, when the caller
        has just counted it (:meth:`contains_prefix` or :meth:`pin_prefix` on the same
        keys, nothing awaited since). The CPU tier is then not walked over those keys
        again; it is asked only for what follows a run a slow tier carried further.
        Ignored when the CPU tier is not read (it counts 0 then).

        Raises:
            InvalidInputError: ``cpu_hits`` is not an int from 0 to ``len(keys)``.
        """
        names = self._tiers.read_from if locations is None else locations
        if cpu_hits is not None:
            _check_count("cpu_hits", cpu_hits, len(keys))
        return await count_prefix(
            keys,
            cpu=self._cpu if self._cpu.name in names else None,
            slow=self._readable(names),
            on_error=self._read_failed,
            cpu_hits=cpu_hits,
        )

    async def locate_prefix(
        self,
        keys: Sequence[bytes],
        locations: Sequence[str] | None = None,
        *,
        cpu_hits: int | None = None,
    ) -> list[tuple[str, int]]:
        """Where the leading run of ``keys`` held across the readable tiers lies: ``(tier
        name, keys)`` for each stretch one tier holds, in prefix order (their sum is what
        :meth:`lookup_prefix` counts; same arguments)."""
        names = self._tiers.read_from if locations is None else locations
        if cpu_hits is not None:
            _check_count("cpu_hits", cpu_hits, len(keys))
        runs: list[tuple[str, int]] = []
        await count_prefix(
            keys,
            cpu=self._cpu if self._cpu.name in names else None,
            slow=self._readable(names),
            on_error=self._read_failed,
            cpu_hits=cpu_hits,
            runs=runs,
        )
        return runs

    def set_read_observer(self, observer: OnRead | None) -> None:
        """Tell ``observer`` of each slow-tier read call: the tier's name, the payload bytes
        it returned (0 for a miss) and the seconds it took (None: tell no one)."""
        self._read_observer = observer

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
        *,
        since: int | None = None,
    ) -> list[MemoryObj]:
        """Payloads of the longest leading run of ``keys`` held anywhere readable, each
        referenced for the caller; no :meth:`lookup_prefix` is needed first.

        Each key comes from the first of: the chunks prefetched for ``lookup_id``, the
        CPU tier, the slow tiers fastest first; the run may pass from one to another and
        back, and ends at the first key none of them returns (missing, corrupt, a failing
        tier, or no pool memory in time). Slow tiers read only from where the run stands,
        with their reads alone (:meth:`StorageBackend.get_prefix`: GETs on Redis, no
        EXISTS); what they return is promoted into the CPU tier (hot cache on, CPU among
        ``locations``), unless the tenant was erased since the mark ``since`` (when the
        caller's read began; None: now): the caller still gets them, no tier does. A
        failing tier is a miss counted in ``tier_read_errors``.
        """
        names = self._tiers.read_from if locations is None else tuple(locations)
        mark = self._epochs.mark() if since is None else since
        pinned = self._pins.get(lookup_id) if lookup_id is not None else None
        return await read_prefix(
            keys,
            pinned=None if pinned is None else pinned.by_key,
            cpu=self._cpu if self._cpu.name in names else None,
            slow=self._readable(names),
            promote=functools.partial(self._promote, names, mark),
            on_error=self._read_failed,
            on_read=self._read_observer,
        )

    def _promote(
        self, names: Sequence[str], mark: int, keys: Sequence[ChunkKey], run: list[MemoryObj]
    ) -> None:
        """Keep in the CPU tier what a slow tier returned, if the CPU tier takes writes and
        no erasure of the tenant came since ``mark``."""
        if self._cpu_writable(tuple(names) if self._cpu.name in names else ()):
            intact = self._epochs.intact(keys, mark)
            if intact:
                self.promoted_chunks += self._cpu.put_nowait(list(keys[:intact]), run[:intact])

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
        *,
        since: int | None = None,
    ) -> int:
        """Cache payloads for ``spans``; returns how many chunks a tier took or queued.

        ``since``: the erasure mark of the store (when it reserved its memory; None: now):
        the run ends before the first chunk of a tenant erased since, in every tier, and
        the slow tiers check it again when each write comes up.

        ``tokens`` (the request's tokens, or None when keys came from engine block hashes)
        fill the KV events: one per tier written, all sharing the tokens the stored event
        keeps (a reference where they cannot change, else one copy; nothing when events
        are off). Nothing is written when frozen; the CPU tier keeps nothing new
        with the hot cache off. With admission (``store_threshold``), chunks the CPU tier
        keeps and that were seen too few times are held back from the slow tiers
        (:meth:`sighted` writes them behind later).
        """
        mark = self._epochs.mark() if since is None else since
        intact = self._epochs.intact([span.key for span in spans], mark)
        if intact < len(spans):
            spans, objs = spans[:intact], objs[:intact]
        if self._frozen or not spans:
            return 0
        targets = self._tiers.store_to if locations is None else tuple(locations)
        keys = [span.key for span in spans]
        stored = self._kv_events.stored(spans, tokens)  # built once, for every tier
        kept = 0
        cpu_holds = self._cpu_writable(targets)
        if cpu_holds:
            if self._cpu.put_nowait(keys, objs) and (event := stored.to(self._cpu.name)):
                self._kv_events.add(event)
            kept = len(keys)
        slow = [tier for tier in self._tiers.slow if tier.name in targets]
        if not slow:
            return kept
        admission = self._admission
        if admission is None or not cpu_holds:
            parts = [(0, len(spans))]
        else:
            parts = self._admitted_parts(admission, spans, tuple(tier.name for tier in slow))
        for start, stop in parts:
            whole = stop - start == len(spans)
            event_of = stored if whole else self._kv_events.stored(spans[start:stop], tokens)
            part_keys = keys if whole else keys[start:stop]
            part_objs = objs if whole else objs[start:stop]
            for tier in slow:
                if not tier.healthy():
                    continue
                writer = self._writers[tier.name]
                event = event_of.to(tier.name)
                if self._wait_for_slow:
                    written = await writer.write(part_keys, part_objs, event, since=mark)
                    kept = max(kept, written)
                elif writer.submit(part_keys, part_objs, event, since=mark):
                    kept = max(kept, stop)
        return kept

    async def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until queued slow-tier writes are done."""
        return await self._writers.flush(timeout)

    def on_evicted(self, keys: list[ChunkKey]) -> None:
        """Record chunks the CPU tier dropped (eviction listener)."""
        self._kv_events.removed(keys, self._cpu.name)
        if self._admission is not None:
            self._admission.release(keys)  # nothing of theirs is left to write behind

    # -- state ----------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, TierStats]:
        return self._tiers.stats()

    def tier_health(self) -> dict[str, bool]:
        return self._tiers.health()

    @property
    def tier_writes_pending(self) -> int:
        return self._writers.pending

    @property
    def tier_writes_dropped(self) -> int:
        return self._writers.dropped

    @property
    def tier_writes_failed(self) -> int:
        return self._writers.failed

    def healthy(self) -> bool:
        """The engine can serve while its CPU tier can: slow tiers down are bypassed."""
        return self._cpu.healthy()

    async def aclose(self, drain_timeout: float = math.inf) -> None:
        """Finish queued slow-tier writes (bounded), then release everything."""
        self._writers.close()
        if not await self.flush(drain_timeout):
            log.warning("tier_writes_abandoned", pending=self.tier_writes_pending)
        self._writers.discard()
        self.release_all_pins()
        for tier in self._tiers.slow:
            try:
                await tier.aclose()
            except Exception:
                log.exception("tier_close_failed", tier=tier.name)
        await self._cpu.aclose()
