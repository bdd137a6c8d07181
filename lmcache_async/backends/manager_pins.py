"""The storage manager's lookup pins: the CPU-tier chunks (or prefetched payloads) a lookup
holds for the load that follows it, by lookup id (:class:`~.pins.PinSets`).

Pins count against their tenant's CPU quota: CPU-tier chunks are in its account already,
prefetched payloads the tier does not hold are charged to it while pinned
(:meth:`~.cpu.CPUBackend.admit_pins`), and a prefetch past the quota pins no further. A
prefetch begun before an erasure of its tenant pins nothing after it (:mod:`.epochs`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from lmcache_async.memory.pool import MemoryObj

from .cpu import CPUBackend
from .epochs import ErasureEpochs
from .pins import PinSets
from .tiers import TierSet

__all__ = ["LookupPins"]


class LookupPins:
    """The pin methods of :class:`~.manager.StorageManager` (its CPU tier, tiers and pin
    sets)."""

    _cpu: CPUBackend
    _tiers: TierSet
    _pins: PinSets
    _epochs: ErasureEpochs

    def pin_prefix(self, keys: Sequence[bytes], lookup_id: Hashable) -> int:
        """Pin the leading CPU-tier keys for ``lookup_id``; returns how many were pinned.

        Pinning again under the same id replaces the earlier pins.
        """
        self._pins.release(lookup_id)
        if self._cpu.name not in self._tiers.read_from:
            return 0
        objs = self._cpu.pin_prefix_nowait(keys)
        if objs:
            self._pins.add(lookup_id, objs)
        return len(objs)

    def pin_objects(
        self,
        keys: Sequence[bytes],
        objs: Sequence[MemoryObj],
        lookup_id: Hashable,
        *,
        since: int | None = None,
    ) -> int:
        """Reference and pin the leading prefetched ``objs`` (of ``keys``) for
        ``lookup_id`` that may land; a retrieve under that id is served from them. The run
        ends at the first chunk of a tenant erased since the mark ``since`` (when the
        reading began; None: now) or past its tenant's CPU quota (counted as a refused
        pin). The id's earlier pins are released first. Returns how many were pinned."""
        self._pins.release(lookup_id)
        mark = self._epochs.mark() if since is None else since
        count = self._epochs.intact(keys[: len(objs)], mark)
        count, charges = self._cpu.admit_pins(keys[:count], objs[:count])
        if not count:
            return 0
        held = [obj.ref() for obj in objs[:count]]
        for obj in held:
            obj.pin()
        self._pins.add(lookup_id, held, dict(zip(keys, held, strict=False)), charges)
        return count

    def lend_pins(self, lookup_id: Hashable) -> tuple[list[MemoryObj], float]:
        """The CPU-tier payloads a lookup pinned for ``lookup_id``, in prefix order, each
        referenced once more for the caller, and the seconds before those pins expire;
        nothing for an id that pins none or pins a prefetch's payloads."""
        pins = self._pins.get(lookup_id)
        if pins is None or pins.by_key:
            return [], 0.0
        return [obj.ref() for obj in pins.objs], self._pins.time_left(lookup_id)

    def holds_pins(self, lookup_id: Hashable) -> bool:
        """Whether chunks are pinned for ``lookup_id``."""
        return self._pins.get(lookup_id) is not None

    def unpin(self, lookup_id: Hashable) -> int:
        """Release the pins of ``lookup_id``; returns how many chunks were released."""
        return self._pins.release(lookup_id)

    def release_all_pins(self) -> int:
        return self._pins.release_all()

    def expire_pins(self) -> int:
        """Release pins whose deadline has passed; returns how many lookup ids expired."""
        return self._pins.expire()

    def next_pin_deadline(self) -> float | None:
        return self._pins.next_deadline()

    @property
    def expired_pins(self) -> int:
        """Lookup ids whose pins were released by their deadline."""
        return self._pins.expired

    @property
    def pinned_chunks(self) -> int:
        return self._pins.chunks

    @property
    def active_lookup_ids(self) -> int:
        return len(self._pins)
