"""KV events: what a KV-aware router needs to know about the cache's contents.

The engine records one event per stored or removed run of chunks in a bounded buffer;
``CacheEngine.take_events()`` drains it. A stored event may be recorded as a
:class:`PendingEvent`, built only when it is taken: a store pays for the event's tuples of
token ids only when somebody reads them. The buffer is bounded in events and in bytes (a
stored event holds its prompt's tokens: a 32k-token prompt's events weigh about 1 MB);
past either bound the oldest events are dropped and counted, so a caller that never drains
cannot grow memory without bound, and a reader learns how many it missed.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import anyio

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EventBuffer",
    "EventKind",
    "KVEvent",
    "PendingEvent",
    "event_bytes",
]


DEFAULT_MAX_BYTES: Final = 64 << 20
"""Bytes an :class:`EventBuffer` holds at most by default."""


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


@dataclass(frozen=True, slots=True)
class PendingEvent:
    """An event recorded now and built when taken (from what it was recorded with, its
    ``ts`` the recording's); ``nbytes`` is what it holds until then."""

    build: Callable[[], KVEvent]
    nbytes: int


_EVENT_BYTES: Final = 200
"""Bytes of an event's object, its tuples and its medium, before the items."""
_ITEM_BYTES: Final = 40
"""Bytes per token id or hash held (a pointer and an int or bytes object)."""


def event_bytes(event: KVEvent) -> int:
    """About how many bytes ``event`` holds in memory."""
    return _EVENT_BYTES + _ITEM_BYTES * (len(event.token_ids) + len(event.block_hashes))


class EventBuffer:
    """A FIFO of :class:`KVEvent` bounded by ``capacity`` events and ``max_bytes`` bytes
    (:func:`event_bytes`); past either, the oldest events are dropped and counted in
    :attr:`dropped`. One event larger than ``max_bytes`` is kept alone (the newest event is
    never the one dropped).

    A consumer (the KV event publisher) awaits :meth:`wait` instead of polling; events are
    added and awaited on the event loop's thread.
    """

    def __init__(
        self, capacity: int, *, max_bytes: int = DEFAULT_MAX_BYTES, enabled: bool = True
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self._events: collections.deque[tuple[KVEvent | PendingEvent, int]] = collections.deque()
        self._capacity = capacity
        self._max_bytes = max_bytes
        self.nbytes = 0
        """Bytes the buffered events hold (estimated)."""
        self._enabled = enabled
        self._waiter: anyio.Event | None = None
        self.dropped = 0
        """Events dropped, oldest first, to stay within the bounds."""

    @property
    def enabled(self) -> bool:
        return self._enabled

    def add(self, event: KVEvent | PendingEvent) -> None:
        if not self._enabled:
            return
        size = event.nbytes if isinstance(event, PendingEvent) else event_bytes(event)
        events = self._events
        events.append((event, size))
        self.nbytes += size
        while len(events) > 1 and (len(events) > self._capacity or self.nbytes > self._max_bytes):
            self.nbytes -= events.popleft()[1]
            self.dropped += 1
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()

    def extend(self, events: Iterable[KVEvent | PendingEvent]) -> None:
        for event in events:
            self.add(event)

    def take(self) -> list[KVEvent]:
        """Return and forget every buffered event, oldest first (pending ones built)."""
        events = [
            event if isinstance(event, KVEvent) else event.build() for event, _ in self._events
        ]
        self._events.clear()
        self.nbytes = 0
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
