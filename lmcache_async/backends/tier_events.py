"""The KV events of the tiers' contents: which chunks a store put into a tier, and which
chunks left one (removed, cleared or evicted), for a KV-aware router.

One event names one tier (its ``medium``); events go to the engine's bounded
:class:`~lmcache_async.events.EventBuffer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..events import EventBuffer, EventKind, KVEvent
from ..keys import ChunkKey, ChunkSpan

__all__ = ["StoredEvent", "TierEvents"]


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

    def add(self, event: KVEvent) -> None:
        """Record ``event``."""
        self.buffer.add(event)

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
    """The stored event of one put, built once and shared by the tiers it goes to.

    The first tier's event is built from the spans (the tokens copied out of the array
    once); every other tier's is that event with its own ``medium``, sharing the same
    hashes and token ids.
    """

    def __init__(
        self, events: TierEvents, spans: Sequence[ChunkSpan], tokens: np.ndarray | None
    ) -> None:
        self._events = events
        self._spans = spans
        self._tokens = tokens
        self._first: KVEvent | None = None

    def to(self, medium: str) -> KVEvent | None:
        """The event of these chunks entering ``medium`` (not recorded yet: a write behind
        records it once the tier took the chunks); None when events are off."""
        if not self._events.enabled:
            return None
        if self._first is None:
            spans = self._spans
            token_ids: tuple[int, ...] = ()
            if self._tokens is not None:
                token_ids = tuple(self._tokens[spans[0].start : spans[-1].end].tolist())
            self._first = KVEvent(
                kind=EventKind.STORED,
                block_hashes=tuple(span.key.digest for span in spans),
                parent_block_hash=spans[0].parent.digest if spans[0].parent else None,
                token_ids=token_ids,
                block_size=self._events.chunk_size,
                medium=medium,
            )
            return self._first
        return dataclasses.replace(self._first, medium=medium)
