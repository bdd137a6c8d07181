"""KV events: what a KV-aware router needs to know about the cache's contents.

The engine records one event per stored or removed run of chunks in a bounded buffer;
``CacheEngine.take_events()`` drains it. A stored event may be recorded as a
:data:`PendingEvent`, built only when it is taken: a store pays for the event's tuples of
token ids only when somebody reads them. When the buffer is full the oldest events are
dropped and counted, so a caller that never drains cannot grow memory without bound.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeAlias

import anyio

__all__ = ["EventBuffer", "EventKind", "KVEvent", "PendingEvent"]


class EventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    """Every chunk of every tier is gone (a ``clear`` of all tiers)."""


@dataclass(frozen=True, slots=True)
class KVEvent:
    """Chunks that entered (``stored``) or left (``removed``) a tier.

    ``block_hashes`` are the chunk key digests in prefix order; ``parent_block_hash`` is the
    digest of the chunk before the first one (None at the start of a prompt or when unknown);
    ``token_ids`` are the tokens the chunks cover (empty for ``removed``); ``block_size`` is
    the chunk size in tokens; ``medium`` names the tier (``"cpu"``); ``ts`` is when the event
    was recorded (seconds since the epoch; not part of equality).
    """

    kind: EventKind
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    ts: float = field(default_factory=time.time, compare=False)


PendingEvent: TypeAlias = Callable[[], KVEvent]
"""An event recorded now and built when taken (from what it was recorded with, its
``ts`` the recording's)."""


class EventBuffer:
    """A bounded FIFO of :class:`KVEvent`; when full, the oldest event is dropped.

    A consumer (the KV event publisher) awaits :meth:`wait` instead of polling; events are
    added and awaited on the event loop's thread.
    """

    def __init__(self, capacity: int, *, enabled: bool = True) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._events: collections.deque[KVEvent | PendingEvent] = collections.deque(maxlen=capacity)
        self._enabled = enabled
        self._waiter: anyio.Event | None = None
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return self._enabled

    def add(self, event: KVEvent | PendingEvent) -> None:
        if not self._enabled:
            return
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()

    def extend(self, events: Iterable[KVEvent | PendingEvent]) -> None:
        for event in events:
            self.add(event)

    def take(self) -> list[KVEvent]:
        """Return and forget every buffered event, oldest first (pending ones built)."""
        events = [event if isinstance(event, KVEvent) else event() for event in self._events]
        self._events.clear()
        return events

    async def wait(self) -> None:
        """Return once at least one event is buffered (at once if one already is).

        Never returns while recording is disabled; bound it with a cancel scope.
        """
        while not self._events:
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()

    def __len__(self) -> int:
        return len(self._events)
