"""The disk tier's read path around the file reads: pool memory for each record the
index holds, then each outcome settled (a hit handed over, a corrupt or vanished record
forgotten and its memory released)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from lmcache_async.keys.chunks import ChunkKey
from lmcache_async.logging import get_logger
from lmcache_async.memory.pool import MemoryObj, MemoryPool, waited_in_vain

from ..errors import AllocationTimeoutError
from .counters import TierCounters
from .disk_file import ReadOutcome, ReadStatus, as_key
from .disk_index import DiskEntry, DiskIndex
from .record import RecordSpec

__all__ = ["Job", "allocate_reads", "settle_reads"]

log = get_logger(__name__)

Job: TypeAlias = tuple[int, bytes, DiskEntry, MemoryObj]
"""A read to do: the key's position in the get, the key, its index entry, its object."""


async def allocate_reads(
    pool: MemoryPool,
    spec: RecordSpec,
    index: DiskIndex,
    keys: Sequence[ChunkKey],
    *,
    timeout: float,
    jobs: list[Job],
) -> None:
    """A pool object for each key ``index`` holds, in order, into ``jobs``; stops at the
    first that gets no memory in time."""
    for i, key in enumerate(keys):
        entry = index.get(key)
        if entry is None:
            continue
        try:
            obj = await pool.allocate(index.shape_of(entry), spec.dtype, timeout=timeout)
        except AllocationTimeoutError:
            (log.warning if waited_in_vain() else log.debug)(
                "disk_tier_allocation_timeout", keys=len(keys) - i, timeout=timeout
            )
            return
        jobs.append((i, key, entry, obj))


def settle_reads(
    index: DiskIndex,
    counts: TierCounters,
    jobs: list[Job],
    outcomes: list[ReadOutcome],
    out: list[MemoryObj | None],
) -> list[ChunkKey]:
    """Hand verified objects to ``out``; release the rest and drop the index entries of
    records found corrupt or missing. Returns the keys the index forgot (gone from the
    tier)."""
    read_errors: list[str] = []
    forgotten: list[ChunkKey] = []
    for (i, key, entry, obj), outcome in zip(jobs, outcomes, strict=True):
        if index.settle(key, entry, outcome.status):
            forgotten.append(as_key(key))
        if outcome.status is ReadStatus.OK:
            out[i] = obj
            continue
        obj.unref()
        if outcome.status is ReadStatus.ERROR:
            read_errors.append(outcome.reason)
        elif outcome.status is ReadStatus.CORRUPT:
            counts.corrupt += 1
            log.warning(
                "tier_entry_corrupt", tier="disk", key=as_key(key).to_str(), reason=outcome.reason
            )
        else:
            log.debug("disk_tier_entry_vanished", key=as_key(key).to_str())
    if read_errors:
        counts.errors += 1
        log.warning("disk_tier_read_failed", chunks=len(read_errors), error=read_errors[0])
    return forgotten
