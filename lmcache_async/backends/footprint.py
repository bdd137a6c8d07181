"""What the CPU tier costs per chunk beyond the chunk's payload: the memory its index, its
payload objects and the KV events of its stores hold, measured with :mod:`tracemalloc`.

:func:`measure_cpu_tier` stores chunks the way the engine does (a token list turned into
int32 by :func:`~lmcache_async.keys.tokens.token_array`, hashed into spans, payloads
allocated from the pool, :meth:`StorageManager.put <.manager.StorageManager.put>`, the
caller's references dropped) and counts what is left allocated. ``tracemalloc`` sees
Python's allocations only: memory torch allocates for itself (a tensor's C++ structures)
is not counted, which is why no chunk keeps a tensor of its own. So
:func:`measure_resident` counts what the process's resident memory grows by instead:
everything each chunk holds, whoever allocated it (Linux; None elsewhere). Memory a
process freed earlier is reused unseen, so that figure means something in a fresh process
only (``bench --scale`` runs it in one).
"""

from __future__ import annotations

import gc
import math
import os
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

__all__ = ["CPUTierFootprint", "measure_cpu_tier", "measure_resident"]


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


def _check_counts(chunks: int, chunk_tokens: int, token_bytes: int, per_store: int) -> None:
    if min(chunks, chunk_tokens, token_bytes, per_store) <= 0:
        raise InvalidInputError(
            "chunks, chunk_tokens, token_bytes and chunks_per_store must be > 0"
        )


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
    _check_counts(chunks, chunk_tokens, token_bytes, chunks_per_store)
    traced = await _fill(
        chunks, chunk_tokens, token_bytes, chunks_per_store, events, seed, traced=True
    )
    return CPUTierFootprint(
        chunks=traced.held,
        chunk_bytes=chunk_tokens * token_bytes,
        pool_bytes_per_chunk=traced.pool_used / chunks,
        overhead_bytes_per_chunk=traced.grown / chunks,
        events=events,
    )


async def measure_resident(
    chunks: int,
    *,
    chunk_tokens: int = 256,
    token_bytes: int = 16,
    chunks_per_store: int = 100,
    events: bool = False,
    seed: int = 0,
) -> float | None:
    """Bytes of resident memory each chunk holds beyond its payload, filled as
    :func:`measure_cpu_tier` fills the tier; None where ``/proc`` does not say. Meaningful
    in a fresh process (see the module doc).

    Raises:
        InvalidInputError: a count or size is not positive.
    """
    _check_counts(chunks, chunk_tokens, token_bytes, chunks_per_store)
    if _resident_bytes() is None:
        return None
    filled = await _fill(
        chunks, chunk_tokens, token_bytes, chunks_per_store, events, seed, traced=False
    )
    return filled.grown / chunks


class _Filled(NamedTuple):
    held: int
    pool_used: int
    grown: int
    """Bytes the fill left allocated (traced), or resident beyond the pool's used pages."""


def _resident_bytes() -> int | None:
    """This process's resident memory, or None where ``/proc`` does not say."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


async def _fill(  # noqa: PLR0917 (the arguments of the two measures, passed on)
    chunks: int,
    chunk_tokens: int,
    token_bytes: int,
    chunks_per_store: int,
    events: bool,
    seed: int,
    *,
    traced: bool,
) -> _Filled:
    """One pass of :func:`measure_cpu_tier`: a tier filled with ``chunks`` chunks, and what
    it left allocated (``traced``) or resident. The stores write no payload: the pool's
    pages stay as they were, and what grows is what the chunks hold."""
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

    def measure() -> int:
        gc.collect()
        if traced:
            return tracemalloc.get_traced_memory()[0]
        return _resident_bytes() or 0

    started = traced and not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        await store(1)  # the first store builds what every later one shares
        cpu.clear_nowait()
        buffer.take()
        before = measure()
        done = 0
        while done < chunks:
            count = min(chunks_per_store, chunks - done)
            await store(count)
            done += count
        grown = measure() - before
        used = pool.stats().used_bytes
        held_chunks = len(cpu)
    finally:
        if started:
            tracemalloc.stop()
        cpu.clear_nowait()
        await manager.aclose()
        pool.close()
    return _Filled(held_chunks, used, grown)
