"""Lookups, pins and prefetches: how much of a prompt is cached, held until it is loaded.

:class:`Lookups` counts a prompt's cached prefix across tiers (it may begin in the CPU
tier and continue on disk or in Redis), pins the CPU tier's part for a lookup id when
asked, starts prefetches through the load core, and releases pins that outlive
``pin_timeout`` (a caller that forgot them). Lookups are counted in all and by tenant.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import anyio
from anyio import CancelScope
from anyio.abc import TaskStatus

from lmcache_async.tenancy.tenants import TAG_BYTES

from ..backends.manager import StorageManager
from ..config import EngineConfig
from ..core import LoadCore
from ..pipelines.layerwise import LayerwisePipeline
from ..stats import Counters

__all__ = ["Lookups"]


class Lookups:
    """The lookup rules over one storage manager (and the layerwise entries)."""

    def __init__(
        self,
        config: EngineConfig,
        manager: StorageManager,
        load: LoadCore,
        layerwise: LayerwisePipeline,
        counters: Counters,
        *,
        healthy: Callable[[], bool],
        sighted: Callable[[Sequence[bytes]], None] | None = None,
    ) -> None:
        self._chunk_size = config.chunk_size
        self._layerwise_keys = config.use_layerwise
        self._manager = manager
        self._load = load
        self._layerwise = layerwise
        self._counters = counters
        self._healthy = healthy
        self._sighted = sighted
        self._pins_changed = anyio.Event()
        self._reaper_scope: CancelScope | None = None
        self._reaper_stopped = anyio.Event()

    def healthy(self) -> bool:
        return self._healthy()

    def sight(self, keys: Sequence[bytes]) -> None:
        """One sighting of a prompt's chunk ``keys`` (store admission counts them)."""
        if self._sighted is not None and keys:
            self._sighted(keys)

    def pins_changed(self) -> None:
        """Wake the reaper: a pin set was added, its deadline may be the next."""
        self._pins_changed.set()

    # -- counting ---------------------------------------------------------------------------

    def _hit_tokens(self, hits: int, ends: list[int], num_tokens: int) -> int:
        if not hits:
            return 0
        if ends:
            return ends[hits - 1]
        return min(hits * self._chunk_size, num_tokens)

    def count_hits(self, keys: Sequence[bytes], hits: int, ends: list[int], num_tokens: int) -> int:
        """The prefix tokens ``hits`` leading chunks cover, counted as a lookup's hits, in
        all and for the tenant of ``keys``."""
        hit_tokens = self._hit_tokens(hits, ends, num_tokens)
        self._counters.lookup_hit_tokens += hit_tokens
        self.count_tenant(keys, num_tokens, hit_tokens)
        return hit_tokens

    def count_tenant(self, keys: Sequence[bytes], num_tokens: int, hit_tokens: int) -> None:
        """One lookup of the tenant whose tag leads ``keys`` (a request is one tenant's:
        its first key names it)."""
        if keys:
            self._counters.tenants.count(keys[0][:TAG_BYTES], num_tokens, hit_tokens)

    def count_request(self, num_tokens: int) -> None:
        """One lookup of a prompt of ``num_tokens`` tokens."""
        self._counters.lookup_requests += 1
        self._counters.lookup_tokens += num_tokens

    def pin_cpu(self, keys: Sequence[bytes], lookup_id: Hashable) -> int:
        """Pin for ``lookup_id`` the leading keys the CPU tier holds; returns how many."""
        hits = self._manager.pin_prefix(keys, lookup_id)
        self._pins_changed.set()
        return hits

    def now(
        self,
        keys: Sequence[bytes],
        ends: list[int],
        num_tokens: int,
        *,
        lookup_id: Hashable | None,
        pin: bool,
    ) -> int | None:
        """A lookup over the configured tiers answered when the CPU tier answers it alone
        (it holds the whole prefix, or there is no slower tier); None, with nothing pinned
        or counted, when disk or Redis must be asked."""
        if self._layerwise_keys or not self._healthy():
            return None
        cpu_hits = self._manager.contains_prefix(keys)
        return self._answer_now(keys, ends, num_tokens, cpu_hits, lookup_id=lookup_id, pin=pin)

    def _answer_now(
        self,
        keys: Sequence[bytes],
        ends: list[int],
        num_tokens: int,
        cpu_hits: int,
        *,
        lookup_id: Hashable | None,
        pin: bool,
    ) -> int | None:
        if self._manager.reads_slow_tiers(None) and cpu_hits < len(keys):
            return None
        hits = self.pin_cpu(keys, lookup_id) if pin and lookup_id is not None else cpu_hits
        self.count_request(num_tokens)
        self.sight(keys)
        return self.count_hits(keys, hits, ends, num_tokens)

    async def lookup(
        self,
        keys: Sequence[bytes],
        ends: list[int],
        num_tokens: int,
        *,
        lookup_id: Hashable | None,
        pin: bool,
        locations: tuple[str, ...] | None,
    ) -> int:
        """The cached prefix tokens of a prompt's chunk keys; with ``pin`` and a
        ``lookup_id``, the CPU tier's part is pinned for it. The CPU tier is walked once."""
        manager = self._manager
        cpu_hits: int | None = None
        if locations is None and not self._layerwise_keys and self._healthy():
            cpu_hits = manager.contains_prefix(keys)
            answered = self._answer_now(
                keys, ends, num_tokens, cpu_hits, lookup_id=lookup_id, pin=pin
            )
            if answered is not None:
                return answered
        self.count_request(num_tokens)
        self.sight(keys)
        if not self._healthy():
            self.count_tenant(keys, num_tokens, 0)
            return 0
        slow = manager.reads_slow_tiers(None) or locations is not None
        if self._layerwise_keys:
            hits = await self._layerwise_hits(
                keys, lookup_id=lookup_id, pin=pin, slow=slow, locations=locations
            )
        elif pin and lookup_id is not None:
            hits = self.pin_cpu(keys, lookup_id)
            if hits < len(keys) and slow:
                hits = await manager.lookup_prefix(keys, locations, cpu_hits=hits)
        elif slow:
            hits = await manager.lookup_prefix(keys, locations, cpu_hits=cpu_hits)
        else:
            hits = manager.contains_prefix(keys)
        return self.count_hits(keys, hits, ends, num_tokens)

    async def _layerwise_hits(
        self,
        keys: Sequence[bytes],
        *,
        lookup_id: Hashable | None,
        pin: bool,
        slow: bool,
        locations: tuple[str, ...] | None,
    ) -> int:
        """Leading chunks whose every layer entry is held (layerwise stores keep one per
        layer); with a pin, the CPU tier's are pinned."""
        if pin and lookup_id is not None:
            hits = self._layerwise.pin(keys, lookup_id)
            self._pins_changed.set()
            if hits < len(keys) and slow:
                # Pins hold the CPU tier; the rest of the prefix may be on disk or in
                # Redis, where the retrieve reads it.
                hits = max(hits, await self._layerwise.lookup(keys, locations))
            return hits
        return await self._layerwise.lookup(keys, locations)

    async def prefetch(
        self,
        keys: Sequence[bytes],
        ends: list[int],
        num_tokens: int,
        *,
        lookup_id: Hashable,
        locations: tuple[str, ...] | None,
    ) -> int:
        """Count a prompt's cached prefix and start loading it into host memory (pinned
        for ``lookup_id``); returns the prefix tokens cached."""
        self.count_request(num_tokens)
        self.sight(keys)
        if not self._healthy():
            self.count_tenant(keys, num_tokens, 0)
            return 0
        hits = await self._manager.lookup_prefix(keys, locations)
        if hits:
            self._load.prefetch(keys[:hits], locations, lookup_id)
        return self.count_hits(keys, hits, ends, num_tokens)

    # -- pin expiry -------------------------------------------------------------------------

    async def reap_pins(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Release lookup pins that outlive ``pin_timeout``, until :meth:`stop_reaping`."""
        try:
            with anyio.CancelScope() as self._reaper_scope:
                task_status.started()
                while True:
                    deadline = self._manager.next_pin_deadline()
                    if deadline is None:
                        await self._pins_changed.wait()
                        self._pins_changed = anyio.Event()
                        continue
                    await anyio.sleep(max(0.0, deadline - time.monotonic()))
                    self._manager.expire_pins()
        finally:
            self._reaper_stopped.set()

    async def stop_reaping(self) -> None:
        """Stop the reaper and wait until it has."""
        if self._reaper_scope is not None:
            self._reaper_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._reaper_stopped.wait()
