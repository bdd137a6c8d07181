"""Re-encoding a cached prefix in a slow tier (compress, decompress)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger

from ..backends.base import StorageBackend
from ..backends.manager import chunk_keys
from ..backends.record import RecordSpec

__all__ = ["reencode_prefix"]

log = get_logger(__name__)


Intact = Callable[[Sequence[bytes]], int]
"""How many leading keys no erasure of their tenant reached since the work began."""

Rewriting = Callable[[str, Sequence[ChunkKey]], contextlib.AbstractContextManager[list[ChunkKey]]]
"""Holds back the removed events of keys a tier is writing again; the list it yields takes
the keys written back (:meth:`~lmcache_async.backends.manager.StorageManager.rewriting`)."""


async def reencode_prefix(
    tier: StorageBackend,
    keys: Sequence[bytes],
    spec: RecordSpec,
    *,
    batch_chunks: int,
    intact: Intact | None = None,
    rewriting: Rewriting | None = None,
) -> int:
    """Rewrite the leading run of ``keys`` that ``tier`` holds with ``spec``'s codec,
    ``batch_chunks`` at a time; returns the number of chunks re-encoded. A chunk that
    vanishes midway ends the run, and so does one of a tenant erased since the work began
    (``intact``): what was read before an erasure is never written back after it. Each
    batch is removed and written again within ``rewriting``: its chunks stay, so no
    removal is announced but of those not written back (a failed or partial write)."""
    as_keys = chunk_keys(keys)
    hits = await tier.contains_prefix(as_keys)
    done = 0
    for start in range(0, hits, batch_chunks):
        batch = as_keys[start : min(start + batch_chunks, hits)]
        got = await tier.get(batch)
        objs = [obj for obj in got if obj is not None]
        try:
            if len(objs) < len(batch):
                break
            held: contextlib.AbstractContextManager[list[ChunkKey]] = (
                contextlib.nullcontext([]) if rewriting is None else rewriting(tier.name, batch)
            )
            with held as back:
                await tier.remove(batch)
                if intact is not None and intact(batch) < len(batch):
                    break  # erased meanwhile: what was read is not written back
                written = await tier.put(batch, objs, spec=spec)
                if written == len(batch):
                    back.extend(batch)
                done += written
        finally:
            for obj in objs:
                obj.unref()
    log.info("chunks_reencoded", location=tier.name, method=str(spec.codec), chunks=done)
    return done
