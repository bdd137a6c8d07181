"""The KV events of the tiers' contents: which chunks a store put into a tier, and which
chunks left one (removed, cleared or evicted), for a KV-aware router.

One event names one tier (its ``medium``); events go to the engine's bounded
:class:`~lmcache_async.events.EventBuffer`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Final

import numpy as np

from lmcache_async.keys.chunks import ChunkKey, ChunkSpan
from lmcache_async.keys.tokens import tokens_fixed

from ..events import EventBuffer, EventKind, KVEvent, PendingEvent

__all__ = ["StoredEvent", "TierEvents"]

_PENDING_BYTES: Final = 200
"""Bytes of a pending event's objects, before its keys and tokens."""
_KEY_BYTES: Final = 100
"""Bytes per chunk key a pending event holds (shared with the tier while it holds the
chunk; the event's alone after that)."""


class TierEvents:
    """Builds the KV events of chunks of ``chunk_size`` tokens and records them in
    ``buffer``."""

    def __init__(self, buffer: EventBuffer, *, chunk_size: int) -> None:
        self.buffer = buffer
        self.chunk_size = chunk_size

    @property
    def enabled(self) -> bool:
        """Whether events are recorded at all (when not, none is built)."""
        return self.buffer.enabled

    def stored(self, spans: Sequence[ChunkSpan], tokens: np.ndarray | None) -> StoredEvent:
        """The stored event of one put of ``spans``, for every tier the put goes to.

        ``tokens`` are the request's tokens, or None when the keys came from engine block
        hashes. Nothing is built until a tier asks (:meth:`StoredEvent.to`).
        """
        return StoredEvent(self, spans, tokens)

    def add(self, event: KVEvent | PendingEvent) -> None:
        """Record ``event``."""
        self.buffer.add(event)

    def cleared(self) -> None:
        """Record that every tier was emptied."""
        if self.enabled:
            self.buffer.add(
                KVEvent(
                    kind=EventKind.CLEARED,
                    block_hashes=(),
                    parent_block_hash=None,
                    token_ids=(),
                    block_size=self.chunk_size,
                    medium="*",
                )
            )

    def removed(self, keys: Sequence[ChunkKey], medium: str) -> None:
        """Record that ``keys`` left ``medium`` (nothing when ``keys`` is empty or events
        are off)."""
        if keys and self.enabled:
            self.buffer.add(
                KVEvent(
                    kind=EventKind.REMOVED,
                    block_hashes=tuple(key.digest for key in keys),
                    parent_block_hash=None,
                    token_ids=(),
                    block_size=self.chunk_size,
                    medium=medium,
                )
            )


class StoredEvent:
    """The stored event of one put, shared by the tiers it goes to, and built only when
    somebody takes it.

    The put's keys are kept, and its tokens: a reference where they can never change
    (the engine's own int32 conversion, :func:`~lmcache_async.keys.tokens.tokens_fixed`)
    and the put covers at least half of them, else a copy of the put's part (the
    caller's array may change later). The first event taken builds the hashes and token
    ids once, and every other tier's event is that one with its own ``medium`` and time,
    sharing them. Nothing is kept when events are off.
    """

    __slots__ = ("_events", "_first", "_held", "_keys", "_parent", "_tokens")

    def __init__(
        self, events: TierEvents, spans: Sequence[ChunkSpan], tokens: np.ndarray | None
    ) -> None:
        self._events = events
        self._first: KVEvent | None = None
        self._keys: tuple[ChunkKey, ...] = ()
        self._parent: ChunkKey | None = None
        self._tokens: np.ndarray | None = None
        self._held = 0
        if not spans or not events.enabled:
            return
        self._keys = tuple([span.key for span in spans])
        self._parent = spans[0].parent
        if tokens is not None:
            part = tokens[spans[0].start : spans[-1].end]
            if tokens_fixed(tokens) and 2 * part.nbytes >= tokens.nbytes:
                self._tokens, self._held = part, tokens.nbytes
            else:
                self._tokens = part.copy()
                self._held = part.nbytes

    def to(self, medium: str) -> PendingEvent | None:
        """The event of these chunks entering ``medium``, to be built when taken (not
        recorded yet: a write behind records it once the tier took the chunks); None when
        events are off."""
        if not self._events.enabled or not self._keys:
            return None
        return PendingEvent(functools.partial(self._event, medium, time.time()), self.nbytes)

    @property
    def nbytes(self) -> int:
        """About how many bytes one of these events holds until it is built (all the
        tokens it keeps a reference to)."""
        return _PENDING_BYTES + _KEY_BYTES * len(self._keys) + self._held

    def _event(self, medium: str, ts: float) -> KVEvent:
        first = self._first
        if first is None:
            tokens = self._tokens
            parent = self._parent
            first = self._first = KVEvent(
                kind=EventKind.STORED,
                block_hashes=tuple([key.digest for key in self._keys]),
                parent_block_hash=parent.digest if parent else None,
                token_ids=() if tokens is None else tuple(tokens.tolist()),
                block_size=self._events.chunk_size,
                medium=medium,
                ts=ts,
            )
            return first
        return dataclasses.replace(first, medium=medium, ts=ts)
