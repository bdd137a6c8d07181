"""The start probe: one chunk written, read back and removed on each far tier, timed.

Until a slow tier has served reads, the load-or-recompute model knows nothing of its
speed (and assumes it worth loading). :class:`TierProbe` seeds it at engine start, in the
background: for each far tier (Redis), a read of a key that is not there (the latency of
a call) and a read of a chunk it has just written (latency plus a chunk's bytes), fed to
:meth:`~.costs.LoadCosts.observe` as the storage manager's observer feeds real reads;
then the chunk is removed. The probe's key has a tag of its own, :data:`PROBE_TAG` (no
tenant's name leads to it but by a 1 in 2³² chance; no KV event names its chunks), and 12
random bytes, so it never names a stored chunk and no two engines sharing a Redis meet on
it; its payload is random values of the layout's dtype (what a codec makes of real KV, not
of zeros), from the engine's pool.

Each read is taken :data:`PROBE_READS` times and the fastest kept: a probe at engine start
shares the machine with the serving engine's own start, and contention only ever adds
time. A tier the model judges too slow to read gets no real reads to correct it, so
:meth:`TierProbe.want` asks for the tier to be probed again (at most once per
:data:`REPROBE_INTERVAL` seconds): the cost model calls it when it declines a tier whose
figures are that old.

Each tier's probe is bounded by ``timeout``; a failure or timeout is logged and ignored.
The tiers' own counters count the probe's calls (a put, a hit, a miss). The disk tier is
not probed (:data:`UNPROBED_TIERS`): a chunk just written would be read back from the
page cache, which says nothing of the disk (it would seed it as fast as memory, no better
than "not measured", at the price of a write); its figures come from its real reads.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Final

import anyio
import anyio.to_thread
import torch

from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES

from ..backends.base import StorageBackend
from ..backends.removal_events import PROBE_TAG
from ..layouts import KVLayout
from .costs import LoadCosts

__all__ = [
    "DEFAULT_PROBE_TIMEOUT",
    "PROBE_READS",
    "PROBE_TAG",
    "REPROBE_INTERVAL",
    "UNPROBED_TIERS",
    "TierProbe",
    "probe_key",
]

log = get_logger(__name__)

DEFAULT_PROBE_TIMEOUT: Final = 2.0
"""Seconds each tier's probe may take."""

UNPROBED_TIERS: Final = frozenset({"disk"})
"""Tiers a write read back would not time (the page cache answers)."""

PROBE_READS: Final = 3
"""Times each probe read is taken; the fastest is kept."""

REPROBE_INTERVAL: Final = 30.0
"""Seconds between two probes of one tier asked for by :meth:`TierProbe.want`."""

_CLEANUP_TIMEOUT: Final = 1.0


def probe_key() -> ChunkKey:
    """A whole-chunk key no stored chunk has: the probe's tag and random bytes."""
    return ChunkKey(PROBE_TAG + os.urandom(DIGEST_SIZE - TAG_BYTES))


def _fill(tensor: torch.Tensor) -> None:
    """Random values: normal ones for a float dtype torch can draw in, bytes otherwise."""
    try:
        tensor.normal_()
    except (RuntimeError, NotImplementedError):
        tensor.view(torch.uint8).random_(0, 120)  # finite in every 8-bit float format


def _release(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.unref()


class TierProbe:
    """Probes each of ``tiers()`` (asked when it runs: the tiers are attached at start)
    once, but those named in ``skip``, feeding ``costs``; then again each tier
    :meth:`want` names (at most once per ``reprobe_interval``). :meth:`run` is the task
    body; :meth:`stop` ends it and waits for its cleanup (bounded)."""

    def __init__(
        self,
        costs: LoadCosts,
        pool: MemoryPool,
        layout: KVLayout,
        tiers: Callable[[], Sequence[StorageBackend]],
        *,
        chunk_size: int,
        timeout: float = DEFAULT_PROBE_TIMEOUT,
        skip: frozenset[str] = UNPROBED_TIERS,
        reprobe_interval: float = REPROBE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._costs = costs
        self._pool = pool
        self._shape = layout.payload_shape(chunk_size)
        self._dtype = layout.dtype
        self._tiers = tiers
        self._timeout = timeout
        self._skip = skip
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._began = False
        self._stopped = False
        self._interval = reprobe_interval
        self._clock = clock
        self._last: dict[str, float] = {}  # when each tier was last probed
        self._wanted: set[str] = set()
        self._asked = anyio.Event()
        self._first_pass = anyio.Event()
        self.probed: list[str] = []
        """The tiers probed so far, in order (a tier whose probe failed is not; one
        probed again appears again)."""

    async def run(self) -> None:
        """Probe every tier in turn, then each tier :meth:`want` names, until stopped
        (once: a second run returns)."""
        if self._began:
            return
        if self._stopped:
            self._first_pass.set()
            self._done.set()
            return
        self._began = True
        try:
            with self._scope:
                for tier in self._tiers():
                    if tier.name not in self._skip and tier.healthy():
                        await self._probe_bounded(tier)
                self._first_pass.set()
                while True:
                    await self._asked.wait()
                    self._asked = anyio.Event()
                    wanted, self._wanted = self._wanted, set()
                    for tier in self._tiers():
                        if tier.name in wanted and tier.healthy():
                            await self._probe_bounded(tier)
        finally:
            self._first_pass.set()
            self._done.set()

    def want(self, tier: str) -> bool:
        """Ask for ``tier`` to be probed again soon (the model declines it on figures that
        may be stale); False when it was probed within ``reprobe_interval`` or is not
        probed at all."""
        if tier in self._skip or self._stopped:
            return False
        last = self._last.get(tier)
        if last is not None and self._clock() - last < self._interval:
            return False
        self._last[tier] = self._clock()  # asked now: not again within the interval
        self._wanted.add(tier)
        self._asked.set()
        return True

    async def wait(self) -> None:
        """Return once every tier has been probed once (or the probe was stopped)."""
        await self._first_pass.wait()

    async def stop(self) -> None:
        """End the probe and wait for it (its chunk is still removed, within a second),
        even when the caller is being cancelled."""
        self._stopped = True
        self._scope.cancel()
        if not self._began:
            self._done.set()
            return
        with anyio.move_on_after(2 * _CLEANUP_TIMEOUT, shield=True):
            await self._done.wait()

    async def _probe_bounded(self, tier: StorageBackend) -> None:
        self._last[tier.name] = self._clock()
        try:
            with anyio.move_on_after(self._timeout) as scope:
                await self._probe(tier)
            if scope.cancelled_caught:
                log.warning("tier_probe_timed_out", tier=tier.name, timeout=self._timeout)
        except Exception as exc:
            log.warning("tier_probe_failed", tier=tier.name, error=str(exc))

    async def _probe(self, tier: StorageBackend) -> None:
        obj = self._pool.allocate_nowait(self._shape, self._dtype)
        if obj is None:
            log.info("tier_probe_skipped", tier=tier.name, reason="no_host_memory")
            return
        key = probe_key()
        try:
            await anyio.to_thread.run_sync(_fill, obj.tensor)
            if not await tier.put([key], [obj]):
                log.info("tier_probe_skipped", tier=tier.name, reason="not_stored")
                return
            try:
                # The put opened the way (a connection, a directory): the reads time the
                # tier, not its warming up.
                miss = await self._fastest_read(tier, probe_key())
                hit = await self._fastest_read(tier, key)
            finally:
                with anyio.move_on_after(_CLEANUP_TIMEOUT, shield=True):
                    await tier.remove([key])
        finally:
            obj.unref()
        if not hit[0]:
            log.warning("tier_probe_unread", tier=tier.name)
            return
        self._costs.observe(tier.name, 0, miss[1])
        self._costs.observe(tier.name, hit[0], hit[1])
        self.probed.append(tier.name)
        speed = self._costs.speed(tier.name)
        log.info(
            "tier_probed",
            tier=tier.name,
            latency_s=round(miss[1], 6),
            read_s=round(hit[1], 6),
            nbytes=hit[0],
            throughput_bytes_per_s=None
            if speed is None or not speed.per_byte
            else math.floor(1 / speed.per_byte),
        )

    @classmethod
    async def _fastest_read(cls, tier: StorageBackend, key: ChunkKey) -> tuple[int, float]:
        """The fastest of :data:`PROBE_READS` reads of ``key`` (bytes returned, seconds)."""
        best = await cls._timed_read(tier, key)
        for _ in range(PROBE_READS - 1):
            best = min(best, await cls._timed_read(tier, key), key=lambda read: read[1])
        return best

    @staticmethod
    async def _timed_read(tier: StorageBackend, key: ChunkKey) -> tuple[int, float]:
        """The payload bytes one read call of ``key`` returned, and the seconds it took."""
        began = time.perf_counter()
        got = await tier.get_prefix([key])
        elapsed = time.perf_counter() - began
        nbytes = sum(obj.nbytes for obj in got)
        _release(got)
        return nbytes, elapsed
