"""The load half of the request core: reserve the held prefix → the caller copies → release.

Every rule about what a load serves lives here, for every caller (the embedded retrieve
pipeline, the sidecar serving a client that copies the KV itself): :meth:`LoadCore.begin`
counts the request and waits (bounded) for a prefetch under its lookup id,
:meth:`LoadCore.reserve` takes a reference on the payloads of the leading chunks the tiers
hold (reading those only disk or Redis hold into host memory, verified), the caller copies
out of them, :meth:`LoadCore.release` returns them and :meth:`LoadCore.finish` drops the
lookup's pins and counts the tokens loaded. :meth:`LoadCore.prefetch` loads a prompt's
lower-tier hits into host memory ahead of its retrieve.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import AllocationBudget, MemoryObj

from ..backends.manager import StorageManager, chunk_keys
from ..stats import Counters
from .store import release

__all__ = [
    "PREFETCH_ALLOCATION_WAIT",
    "SLOW_READ_BATCH_BYTES",
    "LoadCore",
    "Prefetch",
    "read_batch_chunks",
]

PREFETCH_ALLOCATION_WAIT: Final = 0.25
"""Seconds a prefetch's allocations may wait for pool memory, in all (eviction is never
waited for: the evictor runs at once)."""

SLOW_READ_BATCH_BYTES: Final = 8 << 20
"""Bytes of the chunks a load reads from disk or Redis in one batch: each batch is copied
out while the next is read, and while it is still in the CPU's caches (a load of 8 chunks
of 3 MiB from Redis took 1.4x the socket's bare GETs in one batch, 0.9-1.0x in batches of
one or two). Chunks already in memory go in batches of ``pipeline_batch_chunks``."""


def read_batch_chunks(batch_chunks: int, chunk_bytes: int) -> int:
    """Chunks of ``chunk_bytes`` in one batch of a load's reads from disk or Redis: at
    most ``batch_chunks``, at least one."""
    return max(1, min(batch_chunks, SLOW_READ_BATCH_BYTES // max(1, chunk_bytes)))


log = get_logger(__name__)


class LoadCore:
    """The load rules over one storage manager."""

    def __init__(
        self,
        manager: StorageManager,
        counters: Counters,
        *,
        batch_chunks: int,
        timeout: float,
        healthy: Callable[[], bool],
        pins_changed: Callable[[], None],
        read_batch: int | None = None,
    ) -> None:
        """``batch_chunks``: chunks in one batch of a load or prefetch; ``read_batch``:
        in one batch of a load's reads from disk or Redis (default ``batch_chunks``, see
        :func:`read_batch_chunks`)."""
        self._manager = manager
        self._counters = counters
        self._batch_chunks = batch_chunks
        self._read_batch = batch_chunks if read_batch is None else read_batch
        self._timeout = timeout
        self._healthy = healthy
        self._pins_changed = pins_changed
        self._prefetches: dict[Hashable, Prefetch] = {}
        self._background: TaskGroup | None = None

    def start(self, task_group: TaskGroup) -> None:
        """Run prefetches in ``task_group`` from now on."""
        self._background = task_group

    async def begin(self, lookup_id: Hashable | None) -> bool:
        """Count a load request and wait (at most ``retrieve_timeout``) for a prefetch
        under ``lookup_id``; True when the cache can serve it."""
        self._counters.retrieve_requests += 1
        if not self._healthy():
            return False
        if lookup_id is not None:
            await self.wait_prefetch(lookup_id)
        return True

    async def wait_prefetch(self, lookup_id: Hashable) -> None:
        """Wait (at most ``retrieve_timeout``) for the prefetch under ``lookup_id`` to be
        over, and forget it: what it read stays pinned for the load. One still reading
        then is stopped (what it read by then is pinned)."""
        prefetch = self._prefetches.pop(lookup_id, None)
        if prefetch is None:
            return
        with anyio.move_on_after(self._timeout):
            await prefetch.done.wait()
        if not prefetch.done.is_set():
            prefetch.stop()

    def drop_prefetch(self, lookup_id: Hashable) -> None:
        """Abandon the prefetch under ``lookup_id`` (it pins nothing more) and release the
        pins it holds."""
        self.stop_prefetch(lookup_id)
        self._manager.unpin(lookup_id)

    def findable(self, keys: Sequence[bytes], locations: Sequence[str] | None) -> int:
        """How many leading ``keys`` a load may find: the CPU tier's count when it is the
        only tier read, else all of them (a slow tier's part is found by reading it, with
        no existence check first)."""
        manager = self._manager
        if not manager.reads_slow_tiers(locations):
            return manager.contains_prefix(keys)
        return len(keys)

    def batches(
        self,
        keys: Sequence[bytes],
        found: int,
        locations: Sequence[str] | None,
        *,
        read_batch: int | None = None,
    ) -> list[range]:
        """The batches, as index ranges, a load of the leading ``found`` of ``keys`` is
        cut into: the run the CPU tier holds now in batches of ``batch_chunks``, the rest
        (read from disk or Redis) in batches of ``read_batch`` (default: the core's)."""
        manager = self._manager
        held = found
        if manager.reads_slow_tiers(locations):
            held = manager.contains_prefix(keys[:found])
        big, small = self._batch_chunks, read_batch or self._read_batch
        ranges = [range(i, min(i + big, held)) for i in range(0, held, big)]
        return ranges + [range(i, min(i + small, found)) for i in range(held, found, small)]

    async def reserve(
        self,
        keys: Sequence[ChunkKey],
        locations: Sequence[str] | None,
        lookup_id: Hashable | None = None,
    ) -> list[MemoryObj]:
        """The payloads of the leading ``keys`` the tiers hold, stopping at the first none
        holds, each referenced for the caller (give them back with :meth:`release`).
        Payloads prefetched or pinned for ``lookup_id`` are used; chunks only disk or
        Redis hold are read into host memory and their checksums verified (a chunk that
        fails is a miss)."""
        if not keys:
            return []
        return await self._manager.fetch_prefix(keys, locations, lookup_id)

    @staticmethod
    def release(objs: Sequence[MemoryObj]) -> None:
        """Return the references :meth:`reserve` gave."""
        release(objs)

    def lend(self, lookup_id: Hashable) -> tuple[list[MemoryObj], float]:
        """The payloads a lookup pinned for ``lookup_id`` (the CPU tier's leading run),
        each referenced for the caller (give them back with :meth:`release`), and the
        seconds left before the pins expire: a caller on the same host copies out of them
        with no load request (:meth:`finish_lent` ends it). Nothing when the engine is
        unhealthy or the id pins none."""
        if not self._healthy():
            return [], 0.0
        return self._manager.lend_pins(lookup_id)

    def finish_lent(self, lookup_id: Hashable, loaded_tokens: int) -> None:
        """End a load served from :meth:`lend`'s payloads: counted as a load request, the
        lookup's pins dropped, the tokens loaded counted."""
        self._counters.retrieve_requests += 1
        self.finish(lookup_id, loaded_tokens)

    def finish(self, lookup_id: Hashable | None, loaded_tokens: int) -> None:
        """End a load: drop the pins held for ``lookup_id`` and count the tokens loaded."""
        if lookup_id is not None:
            self._manager.unpin(lookup_id)
        self._counters.retrieved_tokens += loaded_tokens

    async def remove(self, keys: Sequence[ChunkKey], locations: Sequence[str] | None = None) -> int:
        """Forget chunks that were loaded (``remove_after_retrieve``: the receiver of a
        disaggregated prefill takes the KV once; a move that does not copy) from the named
        tiers (default: all); returns how many were held."""
        if not keys:
            return 0
        return await self._manager.remove(keys, locations)

    # -- prefetch ---------------------------------------------------------------------------

    def prefetch(
        self,
        keys: Sequence[bytes],
        locations: tuple[str, ...] | None,
        lookup_id: Hashable,
        *,
        pinned: int = 0,
        skip: int = 0,
    ) -> Prefetch | None:
        """Start reading ``keys`` (a prompt's leading hits) into host memory in the
        background, pinned for ``lookup_id`` until its load (or ``pin_timeout``); None when
        nothing was started (no keys, or not started). A prefetch under way for the same
        id is stopped first. ``pinned``: leading ``keys`` already pinned for the id (the
        CPU tier's); those pins stay unless the prefetch gets further. ``skip``: leading
        ``keys`` not to read (the serving engine has their KV); counted as read."""
        if not keys or self._background is None:
            return None
        self.stop_prefetch(lookup_id)
        prefetch = Prefetch(chunks=pinned, since=self._manager.erasure_mark)
        self._prefetches[lookup_id] = prefetch
        self._background.start_soon(
            self._prefetch, list(keys), skip, locations, lookup_id, prefetch
        )
        return prefetch

    def prefetching(self, lookup_id: Hashable) -> Prefetch | None:
        """The prefetch started for ``lookup_id`` and not yet waited for by its load."""
        return self._prefetches.get(lookup_id)

    def stop_prefetch(self, lookup_id: Hashable) -> None:
        """Abandon the prefetch of ``lookup_id`` (replaced, or its pins released): it stops
        and pins nothing."""
        prefetch = self._prefetches.pop(lookup_id, None)
        if prefetch is not None:
            prefetch.abandoned = True
            prefetch.stop()

    async def _prefetch(
        self,
        keys: list[bytes],
        skip: int,
        locations: tuple[str, ...] | None,
        lookup_id: Hashable,
        prefetch: Prefetch,
    ) -> None:
        objs: list[MemoryObj] = []
        try:
            with anyio.move_on_after(self._timeout) as prefetch.scope:
                if prefetch.stopped:
                    prefetch.scope.cancel()
                step = self._batch_chunks
                as_keys = chunk_keys(keys[skip:])
                # A short allowance of waiting for pool memory over the whole prefetch,
                # and a batch holding memory takes only what is free: a promise is what
                # could be reserved, never memory others wait for.
                budget = AllocationBudget(PREFETCH_ALLOCATION_WAIT)
                for start in range(0, len(as_keys), step):
                    batch = as_keys[start : start + step]
                    with budget.scope():
                        got = await self._manager.fetch_prefix(
                            batch, locations, since=prefetch.since
                        )
                    objs.extend(got)
                    if len(got) < len(batch):
                        break
            if not prefetch.abandoned and skip + len(objs) > prefetch.chunks:
                # Past the tenant's CPU quota, or after an erasure of it, fewer are pinned.
                pinned = self._manager.pin_objects(
                    keys[skip : skip + len(objs)], objs, lookup_id, since=prefetch.since
                )
                self._pins_changed()
                prefetch.chunks = skip + pinned
                log.debug("prefetched", lookup_id=str(lookup_id), chunks=pinned, read=len(objs))
        except Exception:
            log.exception("prefetch_failed", lookup_id=str(lookup_id))
        finally:
            release(objs)  # the pin set holds its own references
            prefetch.done.set()


@dataclass(eq=False, slots=True)
class Prefetch:
    """A prefetch in the background: ``done`` once what it read is pinned; ``chunks``: how
    many leading chunks are pinned for its lookup id (those pinned before it began, until
    it pins more); ``since``: the erasure mark taken when it began."""

    done: anyio.Event = field(default_factory=anyio.Event)
    chunks: int = 0
    since: int = 0
    stopped: bool = False
    abandoned: bool = False
    scope: CancelScope | None = None

    def stop(self) -> None:
        """End the reading now; what was read so far is pinned (``done`` follows soon)."""
        self.stopped = True
        if self.scope is not None:
            self.scope.cancel()
