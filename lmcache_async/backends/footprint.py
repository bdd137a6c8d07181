"""What the CPU tier costs per chunk beyond the chunk's payload: the memory its index, its
payload objects and the KV events of its stores hold, measured with :mod:`tracemalloc`.

:func:`measure_cpu_tier` stores chunks the way the engine does (a token list turned into
int32 by :func:`~lmcache_async.keys.tokens.token_array`, hashed into spans, payloads
allocated from the pool, :meth:`StorageManager.put <.manager.StorageManager.put>`, the
caller's references dropped) and counts what is left allocated. ``tracemalloc`` sees
Python's allocations only: memory torch allocates for itself (a tensor's C++ structures)
is not counted, which is why no chunk keeps a tensor of its own.
"""

from __future__ import annotations

import gc
import math
import tracemalloc
from typing import NamedTuple

import numpy as np
import torch

from lmcache_async.keys.chunks import ChunkHasher, Namespace, token_array
from lmcache_async.memory.pool import MemoryPool, page_size_for

from ..errors import InvalidInputError
from ..events import EventBuffer
from .cpu import CPUBackend
from .manager import StorageManager

__all__ = ["CPUTierFootprint", "measure_cpu_tier"]


class CPUTierFootprint(NamedTuple):
    """Figures of one :func:`measure_cpu_tier` run."""

    chunks: int
    """Chunks held by the CPU tier at the end."""
    chunk_bytes: int
    """One chunk's payload bytes."""
    pool_bytes_per_chunk: float
    """Pool memory each chunk takes (its whole pages)."""
    overhead_bytes_per_chunk: float
    """Python memory each chunk holds beyond its payload (tracemalloc)."""
    events: bool
    """Whether KV events were recorded (each store's event kept, none taken)."""


async def measure_cpu_tier(
    chunks: int,
    *,
    chunk_tokens: int = 256,
    token_bytes: int = 16,
    chunks_per_store: int = 100,
    events: bool = True,
    seed: int = 0,
) -> CPUTierFootprint:
    """Store ``chunks`` chunks of ``chunk_tokens`` tokens (``token_bytes`` of KV each) into
    a CPU tier that holds them all, ``chunks_per_store`` per store, and measure what each
    costs. With ``events`` the event buffer keeps every store's event (unbounded here; the
    engine's is bounded by ``max_kv_event_bytes``).

    Raises:
        InvalidInputError: a count or size is not positive.
    """
    if min(chunks, chunk_tokens, token_bytes, chunks_per_store) <= 0:
        raise InvalidInputError(
            "chunks, chunk_tokens, token_bytes and chunks_per_store must be > 0"
        )
    chunk_bytes = chunk_tokens * token_bytes
    page = page_size_for(chunk_bytes)
    pool = MemoryPool(
        chunks * math.ceil(chunk_bytes / page) * page, page_size=page, pin_memory=False
    )
    cpu = CPUBackend(pool)
    buffer = EventBuffer(chunks + 1, max_bytes=1 << 62, enabled=events)
    manager = StorageManager(cpu, events=buffer, chunk_size=chunk_tokens, pin_timeout=60.0)
    hasher = ChunkHasher(Namespace("footprint", "footprint"), chunk_size=chunk_tokens)
    rng = np.random.default_rng(seed)
    shape = (chunk_tokens, token_bytes)

    async def store(count: int) -> None:
        tokens = token_array(rng.integers(0, 50_000, count * chunk_tokens).tolist())
        spans = hasher.array_spans(tokens)
        objs = [pool.allocate_nowait(shape, torch.uint8) for _ in spans]
        held = [obj for obj in objs if obj is not None]
        if len(held) != len(spans):
            raise RuntimeError("the pool holds fewer chunks than it was sized for")
        await manager.put(spans, held, tokens)
        for obj in held:
            obj.unref()

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        await store(1)  # the first store builds what every later one shares
        cpu.clear_nowait()
        buffer.take()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        done = 0
        while done < chunks:
            count = min(chunks_per_store, chunks - done)
            await store(count)
            done += count
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        used = pool.stats().used_bytes
        held_chunks = len(cpu)
    finally:
        if started:
            tracemalloc.stop()
        cpu.clear_nowait()
        await manager.aclose()
        pool.close()
    return CPUTierFootprint(
        chunks=held_chunks,
        chunk_bytes=chunk_bytes,
        pool_bytes_per_chunk=used / chunks,
        overhead_bytes_per_chunk=(after - before) / chunks,
        events=events,
    )
