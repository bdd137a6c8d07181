"""Lookup pins: the chunks a lookup holds for the retrieve that follows it.

A lookup may pin what it found so that eviction cannot take it before the retrieve under
the same lookup id copies it out. Each pin set owns one reference and one pin on each of
its objects and has a deadline: a caller that never releases its pins (a request aborted
upstream) loses them when the deadline passes, at the latest. Everything here runs on the
event loop; no method blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj

__all__ = ["Charges", "Clock", "OnRelease", "PinSet", "PinSets"]

log = get_logger(__name__)

Clock = Callable[[], float]
"""Seconds on a monotonic clock (``time.monotonic`` unless a test passes its own)."""

Charges = list[tuple[bytes, int]]
"""What a pin set's pins were charged to their tenants' quotas: ``(tag, bytes)`` each."""

OnRelease = Callable[[Charges], None]
"""Told of a released set's charges (the quotas they counted against get them back)."""


@dataclass(slots=True)
class PinSet:
    """The objects pinned for one lookup id (one reference and one pin each)."""

    objs: list[MemoryObj]
    deadline: float
    # Prefetched payloads by key, for a retrieve under the same lookup id (they may not be
    # in the CPU tier when the hot cache is off).
    by_key: dict[bytes, MemoryObj] = field(default_factory=dict)
    charges: Charges = field(default_factory=list)


class PinSets:
    """Pin sets by lookup id, each released at the latest ``timeout`` seconds after it was
    made (by :meth:`expire`, which the engine's pin reaper calls). ``on_release`` is told
    of each released set's quota charges."""

    def __init__(
        self, *, timeout: float, clock: Clock, on_release: OnRelease | None = None
    ) -> None:
        self._timeout = timeout
        self._clock = clock
        self._on_release = on_release
        self._sets: dict[Hashable, PinSet] = {}
        self.expired = 0
        """Lookup ids whose pins were released by their deadline."""

    def add(
        self,
        lookup_id: Hashable,
        objs: Sequence[MemoryObj],
        by_key: Mapping[bytes, MemoryObj] | None = None,
        charges: Charges | None = None,
    ) -> None:
        """Keep ``objs`` (already referenced and pinned for the set, which now owns them)
        under ``lookup_id``, replacing (releasing) a set already under that id; ``charges``:
        what the pins were charged to quotas, handed back when the set is released."""
        self.release(lookup_id)
        self._sets[lookup_id] = PinSet(
            list(objs),
            self._clock() + self._timeout,
            dict(by_key) if by_key else {},
            list(charges) if charges else [],
        )

    def get(self, lookup_id: Hashable) -> PinSet | None:
        return self._sets.get(lookup_id)

    def time_left(self, lookup_id: Hashable) -> float:
        """Seconds before the set of ``lookup_id`` expires (0 when there is none)."""
        pins = self._sets.get(lookup_id)
        return 0.0 if pins is None else max(0.0, pins.deadline - self._clock())

    def release(self, lookup_id: Hashable) -> int:
        """Unpin and unreference the set of ``lookup_id``; returns how many chunks it held."""
        pins = self._sets.pop(lookup_id, None)
        if pins is None:
            return 0
        for obj in pins.objs:
            obj.unpin()
            obj.unref()
        if pins.charges and self._on_release is not None:
            self._on_release(pins.charges)
        return len(pins.objs)

    def release_all(self) -> int:
        """Release every set; returns how many chunks they held."""
        return sum(self.release(lookup_id) for lookup_id in list(self._sets))

    def expire(self) -> int:
        """Release the sets whose deadline has passed; returns how many lookup ids expired."""
        now = self._clock()
        expired = [lid for lid, pins in self._sets.items() if pins.deadline <= now]
        for lookup_id in expired:
            chunks = self.release(lookup_id)
            log.warning("lookup_pins_expired", lookup_id=str(lookup_id), chunks=chunks)
        self.expired += len(expired)
        return len(expired)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a set, or None when nothing is pinned."""
        if not self._sets:
            return None
        return min(pins.deadline for pins in self._sets.values())

    @property
    def chunks(self) -> int:
        """Chunks pinned over all sets."""
        return sum(len(pins.objs) for pins in self._sets.values())

    def __len__(self) -> int:
        return len(self._sets)
