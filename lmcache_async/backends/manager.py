"""The storage manager: one front for the tiers, with pins, freeze and the hot-cache switch.

Tiers plug in beside the CPU tier; today the CPU tier is the only one. The manager decides
what a write goes to and what a read comes from; it knows nothing of pipelines or requests.
Everything here runs on the event loop; no method blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from ..events import EventBuffer, EventKind, KVEvent
from ..keys import ChunkKey, ChunkSpan
from ..memory import MemoryObj
from .base import TierStats
from .cpu import CPUBackend

__all__ = ["StorageManager"]

log = structlog.get_logger(__name__)

Clock = Callable[[], float]


@dataclass(slots=True)
class _PinSet:
    objs: list[MemoryObj]
    deadline: float


class StorageManager:
    """Routes reads and writes to the tiers and keeps lookup pins.

    ``pin_timeout``: seconds after which pins a caller never released are released anyway.
    """

    def __init__(
        self,
        cpu: CPUBackend,
        *,
        events: EventBuffer,
        chunk_size: int,
        pin_timeout: float,
        hot_cache: bool = True,
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
        self.expired_pins = 0

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
        return not self._frozen and self._hot_cache

    # -- reads ----------------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys cached (a bare digest finds its whole-chunk key)."""
        return self._cpu.contains_prefix_nowait(keys)

    def contains(self, key: ChunkKey) -> bool:
        return key in self._cpu

    def hold(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """The payload of each cached key, referenced for the caller (None where absent)."""
        return self._cpu.get_nowait(keys)

    def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """Payloads of the leading cached keys, each referenced for the caller."""
        return self._cpu.get_prefix_nowait(keys)

    # -- writes ---------------------------------------------------------------------------

    def put(
        self, spans: Sequence[ChunkSpan], objs: Sequence[MemoryObj], tokens: np.ndarray | None
    ) -> int:
        """Cache payloads for ``spans``; returns how many chunks are now held.

        ``tokens`` (the request's tokens, or None when keys came from engine block hashes)
        fill the KV event. Nothing is written when frozen or with the hot cache off.
        """
        if not self.accepts_writes or not spans:
            return 0
        keys = [span.key for span in spans]
        added = self._cpu.put_nowait(keys, objs)
        if added:
            token_ids: tuple[int, ...] = ()
            if tokens is not None:
                token_ids = tuple(tokens[spans[0].start : spans[-1].end].tolist())
            self._events.add(
                KVEvent(
                    kind=EventKind.STORED,
                    block_hashes=tuple(key.digest for key in keys),
                    parent_block_hash=spans[0].parent.digest if spans[0].parent else None,
                    token_ids=token_ids,
                    block_size=self._chunk_size,
                    medium=self._cpu.name,
                )
            )
        return len(keys)

    def on_evicted(self, keys: list[ChunkKey]) -> None:
        """Record chunks the CPU tier dropped (eviction listener)."""
        self._removed_event(keys)

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        present = [key for key in keys if key in self._cpu]
        removed = self._cpu.remove_nowait(present)
        self._removed_event(present)
        return removed

    def clear(self) -> int:
        """Drop every cached chunk and every pin; returns the number of chunks dropped."""
        self.release_all_pins()
        keys = self._cpu.clear_nowait()
        self._removed_event(keys)
        log.info("cache_cleared", chunks=len(keys))
        return len(keys)

    def _removed_event(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self._events.add(
                KVEvent(
                    kind=EventKind.REMOVED,
                    block_hashes=tuple(key.digest for key in keys),
                    parent_block_hash=None,
                    token_ids=(),
                    block_size=self._chunk_size,
                    medium=self._cpu.name,
                )
            )

    # -- pins -----------------------------------------------------------------------------

    def pin_prefix(self, keys: Sequence[bytes], lookup_id: Hashable) -> int:
        """Pin the leading cached keys for ``lookup_id``; returns how many were pinned.

        Pinning again under the same id replaces the earlier pins.
        """
        self.unpin(lookup_id)
        objs = self._cpu.pin_prefix_nowait(keys)
        if objs:
            self._pins[lookup_id] = _PinSet(objs, self._clock() + self._pin_timeout)
        return len(objs)

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
        return {self._cpu.name: self._cpu.stats()}

    def healthy(self) -> bool:
        return self._cpu.healthy()

    async def aclose(self) -> None:
        self.release_all_pins()
        await self._cpu.aclose()
