"""The connector's KV events, published through vLLM: the blocks this cache holds for the
engine, under the engine's own ``--kv-events-config`` stream and identity.

vLLM's scheduler publishes one stream per engine: its GPU blocks, and what the connector's
``take_events`` yields. The workers collect the cache's events each step
(``get_kv_connector_kv_cache_events``): an embedded engine's own, or those of the sidecar
read from its ``--events`` socket (``sidecar_events``). vLLM gathers them from every worker
and the scheduler side keeps the events all workers agree on (:class:`ConnectorEvents`).

Blocks carry vLLM's own names where the worker knows them: a store of a request names its
blocks by the request's ``block_hashes`` (as vLLM's events convert them: the last 8 bytes,
big-endian), so a router joins our host blocks with vLLM's GPU blocks of the same prompt.
:class:`BlockNames` remembers the most recent stores' names and renames our blocks
(:func:`~lmcache_async.rpc.kv_wire.block_hashes_of`) in stores and removals; a block it no
longer knows keeps our name. A clear of every tier is announced as the removal of every
block the worker knows, from host RAM and disk: vLLM's ``AllBlocksCleared`` would drop the
engine's GPU blocks too.

By default no event of a named tenant (a request's ``cache_salt``) is published: its tokens
are as private as its prompts (``kv_events_tenants`` publishes them).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence
from typing import Final

import zmq
from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

from lmcache_async.errors import ProtocolError
from lmcache_async.events import KVEvent
from lmcache_async.keys.chunks import ChunkHasher
from lmcache_async.logging import get_logger
from lmcache_async.rpc.curve import CurveClientKeys
from lmcache_async.rpc.events import is_public
from lmcache_async.rpc.kv_wire import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireEvent,
    block_hashes_of,
    decode_batch,
    wire_events,
)
from lmcache_async.sync.engine import SyncCacheEngine

__all__ = [
    "DEFAULT_NAMED_BLOCKS",
    "BlockNames",
    "ConnectorEvents",
    "SidecarEvents",
    "WorkerEvents",
    "block_name",
    "to_vllm",
]

log = get_logger(__name__)

DEFAULT_NAMED_BLOCKS: Final = 1 << 18
"""Blocks whose vLLM names a worker remembers (about 100 bytes each)."""

SIDECAR_EVENTS_HWM: Final = 10_000
"""Batches of the sidecar's stream queued between two steps; beyond, ZeroMQ drops them."""

_U64: Final = (1 << 64) - 1
_HASHERS: Final = 64
"""Tenants' key hashers a worker keeps."""


def block_name(block_hash: bytes) -> int:
    """vLLM's name of a block in its KV events: its hash's last 8 bytes, big-endian (what
    ``maybe_convert_block_hash`` makes of it)."""
    return int.from_bytes(block_hash, "big") & _U64


class BlockNames:
    """Our block names (:func:`~lmcache_async.rpc.kv_wire.block_hashes_of`) to vLLM's, for
    the ``capacity`` most recently stored blocks."""

    def __init__(self, capacity: int = DEFAULT_NAMED_BLOCKS) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._names: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._names)

    def learn(self, digests: Sequence[bytes], names: Sequence[int], per_chunk: int) -> None:
        """Remember that the chunks with ``digests`` hold the blocks vLLM names ``names``
        (``per_chunk`` blocks a chunk, in order; a short list names the first blocks)."""
        known = self._names
        for index, digest in enumerate(digests):
            own = block_hashes_of(digest, per_chunk)
            for j, name in enumerate(names[index * per_chunk : (index + 1) * per_chunk]):
                known[own[j]] = name
                known.move_to_end(own[j])
        while len(known) > self._capacity:
            known.popitem(last=False)

    def name(self, own: int) -> int:
        """vLLM's name of our block ``own``, or ``own`` when unknown."""
        return self._names.get(own, own)

    def rename(self, event: WireEvent) -> list[WireEvent]:
        """``event`` under vLLM's names; a clear becomes the removal of every known block."""
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            return [
                BlockStored(
                    block_hashes=tuple(map(self.name, event.block_hashes)),
                    parent_block_hash=None if parent is None else self.name(parent),
                    token_ids=event.token_ids,
                    block_size=event.block_size,
                    medium=event.medium,
                )
            ]
        if isinstance(event, BlockRemoved):
            return [BlockRemoved(tuple(map(self.name, event.block_hashes)), event.medium)]
        everything = tuple(self._names.values())
        if not everything:
            return []
        return [BlockRemoved(everything, medium) for medium in sorted(set(MEDIA.values()))]


def to_vllm(event: WireEvent) -> KVCacheEvent:
    """``event`` as vLLM's own event object."""
    if isinstance(event, BlockStored):
        return VllmBlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=None,
        )
    if isinstance(event, BlockRemoved):
        return VllmBlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium)
    assert isinstance(event, AllBlocksCleared)
    return VllmAllBlocksCleared()


def engine_wire_events(
    events: Sequence[KVEvent], *, block_size: int, chunk_size: int, tenants: bool
) -> list[WireEvent]:
    """An embedded engine's ``events`` as blocks of ``block_size`` (named tenants' left out
    unless ``tenants``)."""
    out = []
    for event in events:
        if not tenants and not is_public(event):
            continue
        wire = wire_events(event, block_size=block_size, chunk_size=chunk_size)
        if wire is not None:
            out.append(wire)
    return out


class ConnectorEvents(KVConnectorKVEvents):
    """The events of one step, from one worker or (merged by vLLM) all of them, in order.

    :meth:`aggregate` keeps what every worker reported: an event ``n`` workers of ``N``
    reported ``k`` times each is kept ``k`` times when ``n == N``, in the order the first
    worker reported it (a store, a removal and a store again of one block stay in that
    order, which counting alone would lose).
    """

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self._events: list[KVCacheEvent] = []
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> ConnectorEvents:
        if self._workers > 1:
            counts = collections.Counter(self._events)
            kept: collections.Counter[KVCacheEvent] = collections.Counter()
            common = []
            for event in self._events:
                if kept[event] < counts[event] // self._workers:
                    kept[event] += 1
                    common.append(event)
            self._events = common
            self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1


class WorkerEvents:
    """One worker's KV events for vLLM: its engine's (embedded) or its sidecar's
    (``sidecar``), blocks of ``block_size`` named as vLLM names them where known.

    :meth:`learn` is called with each store before it runs; :meth:`take` once per step.
    """

    def __init__(
        self,
        *,
        block_size: int,
        chunk_size: int,
        tenants: bool = False,
        sidecar: SidecarEvents | None = None,
        capacity: int = DEFAULT_NAMED_BLOCKS,
    ) -> None:
        self._block_size = block_size
        self._chunk_size = chunk_size
        self._per_chunk = chunk_size // block_size if chunk_size % block_size == 0 else 0
        self._tenants = tenants
        self._sidecar = sidecar
        self.names = BlockNames(capacity)
        self._hashers: collections.OrderedDict[str | None, ChunkHasher] = collections.OrderedDict()

    def learn(
        self,
        base: ChunkHasher | None,
        tokens: Sequence[int],
        tenant: str | None,
        names: Sequence[int],
    ) -> None:
        """Remember vLLM's ``names`` of the blocks of ``tokens`` (``tenant``'s), keyed as
        ``base`` (the engine's key hasher; None: not known yet) keys them."""
        if base is None or not names or not self._per_chunk:
            return
        hasher = self._hashers.get(tenant)
        if hasher is None:
            # A hasher of its own (no memo): this runs on vLLM's thread, not the engine's.
            hasher = ChunkHasher(
                base.namespace.with_tenant(tenant),
                chunk_size=self._chunk_size,
                algorithm=base.algorithm,
            )
            self._hashers[tenant] = hasher
            if len(self._hashers) > _HASHERS:
                self._hashers.popitem(last=False)
        self._hashers.move_to_end(tenant)
        whole = len(names) // self._per_chunk * self._chunk_size
        self.names.learn(hasher.digests(tokens[:whole]), names, self._per_chunk)

    def take(self, engine: SyncCacheEngine | None) -> ConnectorEvents | None:
        """The events since the last call, as vLLM's (None when there are none)."""
        if self._sidecar is not None:
            wire = self._sidecar.take()
        elif engine is not None and not engine.is_remote and self._per_chunk:
            wire = engine_wire_events(
                engine.take_events(),
                block_size=self._block_size,
                chunk_size=self._chunk_size,
                tenants=self._tenants,
            )
        else:
            return None
        events = [to_vllm(renamed) for event in wire for renamed in self.names.rename(event)]
        if not events:
            return None
        out = ConnectorEvents()
        out.add_events(events)
        return out

    def close(self) -> None:
        if self._sidecar is not None:
            self._sidecar.close()


class SidecarEvents:
    """A worker's subscription to its sidecar's KV event stream (``lmcache-async serve
    --events URL``), read without waiting once per step.

    The socket queues at most :data:`SIDECAR_EVENTS_HWM` batches between reads (ZeroMQ
    drops the rest; :attr:`missed` counts the gaps the sequence numbers show). With
    ``curve`` the subscription is a CURVE client with those keys, as the sidecar's
    allow-list demands.
    """

    def __init__(self, url: str, *, curve: CurveClientKeys | None = None) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, SIDECAR_EVENTS_HWM)
        if curve is not None:
            curve.apply(self._socket)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(url)
        self._next_seq: int | None = None
        self.missed = 0
        """Batches the sequence numbers say were lost."""
        self.skipped = 0
        """Messages that were not event batches."""

    def wait(self, timeout: float) -> bool:
        """Whether a batch is waiting to be taken, waiting at most ``timeout`` seconds."""
        return bool(self._socket.poll(int(timeout * 1000), zmq.POLLIN))

    def take(self) -> list[WireEvent]:
        """Every event received since the last call, oldest first (never waits)."""
        events: list[WireEvent] = []
        while True:
            try:
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return events
            except zmq.ZMQError:
                return events  # closed
            if len(frames) != 3 or len(frames[1]) != 8:
                self.skipped += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            try:
                _, batch = decode_batch(frames[2])
            except ProtocolError as exc:
                self.skipped += 1
                log.warning("vllm_sidecar_event_skipped", reason=str(exc))
                continue
            if self._next_seq is not None and seq > self._next_seq:
                self.missed += seq - self._next_seq
            self._next_seq = seq + 1
            events.extend(batch)

    def close(self) -> None:
        """Close the subscription (idempotent)."""
        with contextlib.suppress(zmq.ZMQError):
            self._socket.close(linger=0)
        self._context.term()
