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

from ..events import EventBuffer, EventKind, KVEvent, PendingEvent

__all__ = ["StoredEvent", "TierEvents"]

_PENDING_BYTES: Final = 200
"""Bytes of a pending event's objects, before its spans and tokens."""
_SPAN_BYTES: Final = 120
"""Bytes per chunk span a pending event holds (shared with the store that made it)."""


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
        """Record that ``keys`` left ``medium`` (nothing when ``keys`` is empty)."""
        if keys:
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

    The put's spans and a copy of its tokens are kept (the caller's array may change
    later); the first event taken builds the hashes and token ids once, and every other
    tier's event is that one with its own ``medium`` and time, sharing them.
    """

    def __init__(
        self, events: TierEvents, spans: Sequence[ChunkSpan], tokens: np.ndarray | None
    ) -> None:
        self._events = events
        self._spans = tuple(spans) if events.enabled else ()
        self._tokens = None
        if tokens is not None and spans and events.enabled:
            self._tokens = tokens[spans[0].start : spans[-1].end].copy()
        self._first: KVEvent | None = None

    def to(self, medium: str) -> PendingEvent | None:
        """The event of these chunks entering ``medium``, to be built when taken (not
        recorded yet: a write behind records it once the tier took the chunks); None when
        events are off."""
        if not self._events.enabled:
            return None
        return PendingEvent(functools.partial(self._event, medium, time.time()), self.nbytes)

    @property
    def nbytes(self) -> int:
        """About how many bytes one of these events holds until it is built."""
        held = 0 if self._tokens is None else self._tokens.nbytes
        return _PENDING_BYTES + _SPAN_BYTES * len(self._spans) + held

    def _event(self, medium: str, ts: float) -> KVEvent:
        first = self._first
        if first is None:
            spans = self._spans
            tokens = self._tokens
            first = self._first = KVEvent(
                kind=EventKind.STORED,
                block_hashes=tuple(span.key.digest for span in spans),
                parent_block_hash=spans[0].parent.digest if spans[0].parent else None,
                token_ids=() if tokens is None else tuple(tokens.tolist()),
                block_size=self._events.chunk_size,
                medium=medium,
                ts=ts,
            )
            return first
        return dataclasses.replace(first, medium=medium, ts=ts)
