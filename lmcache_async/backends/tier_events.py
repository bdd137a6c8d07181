"""The KV events of the tiers' contents: which chunks a store put into a tier, and which
chunks left one (removed, cleared or evicted), for a KV-aware router.

One event names one tier (its ``medium``); events go to the engine's bounded
:class:`~lmcache_async.events.EventBuffer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..events import EventBuffer, EventKind, KVEvent
from ..keys import ChunkKey, ChunkSpan

__all__ = ["TierEvents"]


class TierEvents:
    """Builds the KV events of chunks of ``chunk_size`` tokens and records them in
    ``buffer``."""

    def __init__(self, buffer: EventBuffer, *, chunk_size: int) -> None:
        self.buffer = buffer
        self._chunk_size = chunk_size

    def stored(self, spans: Sequence[ChunkSpan], tokens: np.ndarray | None, medium: str) -> KVEvent:
        """The event of ``spans`` stored into ``medium`` (not recorded yet: a write behind
        records it once the tier took the chunks). ``tokens`` are the request's tokens, or
        None when the keys came from engine block hashes."""
        token_ids: tuple[int, ...] = ()
        if tokens is not None:
            token_ids = tuple(tokens[spans[0].start : spans[-1].end].tolist())
        return KVEvent(
            kind=EventKind.STORED,
            block_hashes=tuple(span.key.digest for span in spans),
            parent_block_hash=spans[0].parent.digest if spans[0].parent else None,
            token_ids=token_ids,
            block_size=self._chunk_size,
            medium=medium,
        )

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
                    block_size=self._chunk_size,
                    medium=medium,
                )
            )
