"""The store half of the request core: reserve → the caller fills the buffers → commit.

Every rule about what a store writes lives here, for every caller: the embedded store
pipeline runs these phases as its stages, the sidecar runs them for a client that copies
the KV itself. :meth:`StoreCore.begin` decides the chunks (up to the request's limit; the
ones already held are skipped and held for the request), :meth:`StoreCore.reserve` takes
host memory for them, stopping at the first that cannot be had in time (a partial store:
the prefix it has is stored, never a store with a hole), :meth:`StoreCore.commit` puts the
filled payloads into the tiers, and :meth:`StoreCore.finish` ends the request and counts
it. :meth:`StoreCore.abort` returns reserved memory unused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import numpy as np

from lmcache_async.keys.chunks import ChunkKey, ChunkSpan
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool

from ..backends.manager import StorageManager
from ..errors import AllocationTimeoutError
from ..layouts import KVLayout
from ..stats import Counters

__all__ = ["Cancellable", "StoreCore", "StoreTxn", "layer_keys", "release"]

log = get_logger(__name__)


class Cancellable(Protocol):
    """A request whose waits can be ended from outside (see :meth:`StoreCore.reserve`)."""

    cancelled: bool
    waiting: anyio.CancelScope | None


@dataclass(eq=False, slots=True)
class StoreTxn:
    """One store between :meth:`StoreCore.begin` and :meth:`StoreCore.finish`.

    ``spans``: the chunks the store may write (from the mask start, up to its limit);
    ``todo``: the indices of those not already held; ``stored``: per span, whether it is
    cached. The transaction owns one reference on each object in ``held`` (chunks it
    counts as cached), so the store's own later allocations cannot evict its prefix.
    ``layers``: 0 when each chunk is one payload under its key; ``n`` when it is ``n``
    per-layer payloads under ``key.with_layer(i)`` (a layerwise store), a chunk counting
    as held only when every layer is. ``since``: the erasure mark taken at
    :meth:`StoreCore.begin`; a tenant erased after it gets nothing of the store.
    """

    req_id: str
    spans: list[ChunkSpan]
    tokens: np.ndarray | None
    locations: tuple[str, ...] | None
    stored: list[bool]
    held: list[MemoryObj]
    todo: list[int]
    partial: bool = False
    finished: bool = False
    layers: int = 0
    since: int = 0

    def stored_tokens(self) -> int:
        """Tokens covered by the leading run of chunks that are cached."""
        return _leading_tokens(self.spans, self.stored)


def _leading_tokens(spans: Sequence[ChunkSpan], stored: Sequence[bool]) -> int:
    """Tokens covered by the leading run of ``spans`` whose ``stored`` is True."""
    if not spans:
        return 0
    first = spans[0].start
    end = first
    for span, ok in zip(spans, stored, strict=False):
        if not ok:
            break
        end = span.end
    return end - first


def release(objs: Sequence[MemoryObj]) -> None:
    """Drop the caller's reference on each object."""
    for obj in objs:
        obj.unref()


def layer_keys(keys: Sequence[bytes], num_layers: int) -> list[ChunkKey]:
    """Every layer's key of each chunk key, chunk-major.

    ``keys`` are chunk keys or bare digests; the result is ``[k0@L0, ..., k0@L(n-1), k1@L0,
    ...]``, so the leading run of present keys, divided by ``num_layers``, is the number of
    leading chunks whose every layer is present.

    Raises:
        InvalidInputError: a key is not a digest.
    """
    out: list[ChunkKey] = []
    for key in keys:
        digest = key.digest if isinstance(key, ChunkKey) else bytes(key)
        out.extend(ChunkKey(digest, layer) for layer in range(num_layers))
    return out


class StoreCore:
    """The store rules over one storage manager and host memory pool."""

    def __init__(
        self,
        manager: StorageManager,
        pool: MemoryPool,
        layout: KVLayout,
        counters: Counters,
        *,
        allocation_timeout: float,
        healthy: Callable[[], bool],
    ) -> None:
        self._manager = manager
        self._pool = pool
        self._layout = layout
        self._counters = counters
        self._allocation_timeout = allocation_timeout
        self._healthy = healthy

    def open(self) -> bool:
        """Count a store request; True when the cache takes writes now (healthy, not
        frozen, some target tier writable). A store that gets False stores nothing."""
        self._counters.store_requests += 1
        return self._manager.accepts_writes and self._healthy()

    def begin(
        self,
        req_id: str,
        spans: list[ChunkSpan],
        tokens: np.ndarray | None,
        *,
        limit: int | None,
        locations: tuple[str, ...] | None,
        layers: int = 0,
    ) -> StoreTxn:
        """Decide what a store writes: the chunks of ``spans`` ending at or before
        ``limit`` (None: every chunk; a chunk with a token the caller cannot give, and
        every chunk after it, is not stored); those already held are held for the request
        and skipped. With ``layers`` each chunk is that many per-layer payloads (see
        :class:`StoreTxn`)."""
        if limit is not None and spans and spans[-1].end > limit:
            spans = [span for span in spans if span.end <= limit]
        keys = [span.key for span in spans]
        if not layers:
            found = self._manager.hold(keys)
            stored = [obj is not None for obj in found]
        else:
            found = self._manager.hold(layer_keys(keys, layers))
            stored = [
                all(obj is not None for obj in found[i * layers : (i + 1) * layers])
                for i in range(len(spans))
            ]
        return StoreTxn(
            req_id,
            spans,
            tokens,
            locations,
            stored=stored,
            held=[obj for obj in found if obj is not None],
            todo=[index for index, ok in enumerate(stored) if not ok],
            layers=layers,
            since=self._manager.erasure_mark,
        )

    async def reserve(
        self, txn: StoreTxn, indices: Sequence[int], owner: Cancellable | None = None
    ) -> list[MemoryObj]:
        """Host memory for the payloads of the chunks at ``indices`` (positions in
        ``txn.spans``), in order, each waiting up to ``allocation_timeout`` for room.

        Stops at the first chunk that gets no memory in time (``txn.partial`` is set and
        the store logged as partial) or when ``owner`` is cancelled; the objects returned
        are for ``indices[:len(result) // max(txn.layers, 1)]`` (a layerwise chunk's
        payloads chunk-major, layer by layer), one reference each for the caller (give
        them to :meth:`commit` or :meth:`abort`). A cancellation of the caller returns
        what was taken and propagates.
        """
        layout, pool = self._layout, self._pool
        dtype = layout.dtype
        per_chunk = max(txn.layers, 1)
        shape_of = layout.layer_payload_shape if txn.layers else layout.payload_shape
        objs: list[MemoryObj] = []
        chunk: list[MemoryObj] = []
        pool.make_room(
            per_chunk
            * sum(pool.pages_for(shape_of(txn.spans[index].num_tokens), dtype) for index in indices)
        )
        try:
            for index in indices:
                shape = shape_of(txn.spans[index].num_tokens)
                for _ in range(per_chunk):
                    obj = pool.allocate_nowait(shape, dtype)
                    if obj is None:
                        obj = await self._wait_for_memory(txn, index, shape, owner)
                        if obj is None:
                            break
                    chunk.append(obj)
                if len(chunk) < per_chunk:
                    break  # a chunk is stored whole or not at all
                objs.extend(chunk)
                chunk = []
        except BaseException:
            release(objs)
            raise
        finally:
            release(chunk)
        return objs

    async def _wait_for_memory(
        self,
        txn: StoreTxn,
        index: int,
        shape: tuple[int, ...],
        owner: Cancellable | None,
    ) -> MemoryObj | None:
        """One payload, waiting for room; None when time ran out (partial) or ``owner``
        was cancelled while it waited."""
        dtype = self._layout.dtype
        try:
            if owner is None:
                return await self._pool.allocate(shape, dtype, timeout=self._allocation_timeout)
            with anyio.CancelScope() as owner.waiting:
                if owner.cancelled:
                    owner.waiting.cancel()
                return await self._pool.allocate(shape, dtype, timeout=self._allocation_timeout)
            return None  # the owner was cancelled while it waited
        except AllocationTimeoutError:
            txn.partial = True
            log.warning(
                "store_partial",
                req_id=txn.req_id,
                stored_chunks=index,
                chunks=len(txn.spans),
                reason="host_memory_timeout",
            )
            return None
        finally:
            if owner is not None:
                owner.waiting = None

    async def commit(self, txn: StoreTxn, indices: Sequence[int], objs: Sequence[MemoryObj]) -> int:
        """Put the filled payloads ``objs`` of the chunks at ``indices`` into the tiers
        (the CPU tier now, the slow tiers written behind unless configured otherwise) and
        mark them stored; returns how many leading chunks a tier took (a layerwise chunk:
        every layer); 0 for a tenant erased since :meth:`begin` (an erasure is
        final). The caller's references on ``objs`` are released, whatever happens.

        Raises:
            InvalidInputError: ``txn.locations`` names a tier that is not enabled.
        """
        manager = self._manager
        try:
            spans = [txn.spans[index] for index in indices]
            layers = txn.layers
            if not layers:
                kept = await manager.put(spans, objs, txn.tokens, txn.locations, since=txn.since)
                keys = [span.key for span in spans[:kept]]
            else:
                kept = len(spans)
                for layer in range(layers):
                    layer_spans = [
                        ChunkSpan(span.start, span.end, span.key.with_layer(layer), span.parent)
                        for span in spans
                    ]
                    put = await manager.put(
                        layer_spans,
                        objs[layer::layers],
                        txn.tokens,
                        txn.locations,
                        since=txn.since,
                    )
                    kept = min(kept, put)
                keys = layer_keys([span.key for span in spans[:kept]], layers)
            # Hold what the CPU tier now has under these keys (another store may have put
            # the same chunk first) until the store ends; chunks written to slow tiers only
            # are held by their writers.
            txn.held.extend(obj for obj in manager.hold(keys) if obj is not None)
            for index in indices[:kept]:
                txn.stored[index] = True
            return kept
        finally:
            release(objs)

    def promised(self, txn: StoreTxn, indices: Sequence[int]) -> int | None:
        """The tokens :meth:`finish` will count once the chunks at ``indices`` are
        committed, when the commit cannot keep fewer (:meth:`StorageManager.puts_at_once`;
        an erasure of the tenant in between aside); None when it may (it waits for a
        slow tier, or no tier takes the chunks at once)."""
        if txn.layers or not self._manager.puts_at_once(txn.locations):
            return None
        stored = list(txn.stored)
        for index in indices:
            stored[index] = True
        return _leading_tokens(txn.spans, stored)

    def abort(self, txn: StoreTxn, objs: Sequence[MemoryObj] = ()) -> int:
        """End a store without writing ``objs`` (reserved, maybe filled): every byte of
        memory it took is returned. Returns 0, the tokens it stored."""
        release(objs)
        self._end(txn)
        return 0

    def finish(self, txn: StoreTxn) -> int:
        """End a store and count it; returns the tokens, from its first chunk on, whose
        chunks are cached. Idempotent: a transaction is counted once."""
        stored = txn.stored_tokens()
        if not txn.finished:
            self._counters.stored_tokens += stored
            self._counters.partial_stores += int(txn.partial)
        self._end(txn)
        return stored

    @staticmethod
    def _end(txn: StoreTxn) -> None:
        release(txn.held)
        txn.held.clear()
        txn.finished = True
