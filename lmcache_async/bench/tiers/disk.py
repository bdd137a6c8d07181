"""The disk tier's put and get GB/s next to plain file writes and reads of the same bytes,
and the same tier with its records encrypted."""

from __future__ import annotations

import functools
import os
import shutil
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
import torch

from lmcache_async import ChunkKey, InvalidInputError, TierError
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.record import RecordSpec
from lmcache_async.bench import gbps
from lmcache_async.bench.tiers.common import (
    BENCH_DTYPE,
    BENCH_TOKENS,
    CHUNK_GRANULE,
    ENCRYPTION_TARGETS,
    bench_cipher,
    bench_spec,
    check_count,
    fill_random,
    interleaved,
)
from lmcache_async.keys.chunks import DIGEST_SIZE
from lmcache_async.memory.pool import DEFAULT_PAGE_SIZE, MemoryObj, MemoryPool

__all__ = ["DISK_TARGETS", "bench_disk"]

DISK_TARGETS: Final[Mapping[str, float]] = {"put_ratio": 0.7, "get_ratio": 0.7}
"""The disk tier should reach at least 0.7x the raw write and read of the same bytes."""


async def bench_disk(
    directory: str | os.PathLike[str],
    *,
    chunk_bytes: int = 4 << 20,
    chunks: int = 64,
    repeats: int = 3,
    batch: int = 16,
    cold: bool = False,
    encrypted: bool = True,
) -> dict[str, Any]:
    """Disk tier put/get GB/s against raw file writes/reads of the same bytes, and with
    ``encrypted`` the same tier sealing its records (AES-256-GCM, a random key) against
    the tier in the clear.

    Each run writes ``chunks`` chunks of ``chunk_bytes`` (random bytes) through a fresh
    tier (and a fresh encrypted one) and as plain files, ``batch`` chunks per call, then
    reads them all back; its files are deleted afterwards. Subdirectories ``tier-<run>``,
    ``sealed-<run>`` and ``raw-<run>`` of ``directory`` are used.

    Returns:
        ``put_gbps``, ``raw_write_gbps``, ``put_ratio``, ``get_gbps``, ``raw_read_gbps``,
        ``get_ratio`` (medians over runs); with ``encrypted`` also ``encrypted_put_gbps``,
        ``encrypted_get_gbps`` and their ratios to the tier in the clear,
        ``encrypted_put_ratio`` and ``encrypted_get_ratio``; the settings, the targets and
        ``runs`` (every run's figures).

    Raises:
        InvalidInputError: a count is not a positive int, or ``chunk_bytes`` is not a
            multiple of 1024.
        TierError: a tier lost a chunk or read back other bytes than it was given.
    """
    check_count("chunk_bytes", chunk_bytes)
    check_count("chunks", chunks)
    check_count("repeats", repeats)
    check_count("batch", batch)
    if chunk_bytes % CHUNK_GRANULE:
        raise InvalidInputError(
            f"chunk_bytes must be a multiple of {CHUNK_GRANULE}, got {chunk_bytes}"
        )
    root = Path(os.fspath(directory))
    spec = bench_spec("disk", chunk_bytes)
    sealed = bench_spec("disk", chunk_bytes, bench_cipher()) if encrypted else None
    shape = spec.shape_of(BENCH_TOKENS)
    page = DEFAULT_PAGE_SIZE
    per_chunk = -(-chunk_bytes // page) * page
    # Sources, plus one batch read back by a get and one by the raw reads.
    pool = MemoryPool(per_chunk * (chunks + 2 * min(batch, chunks)), pin_memory=False)
    sources: list[MemoryObj] = []
    try:
        for _ in range(chunks):
            obj = pool.allocate_nowait(shape, BENCH_DTYPE)
            if obj is None:
                raise InvalidInputError("benchmark pool too small")  # sized above: a bug
            sources.append(obj)
        await anyio.to_thread.run_sync(fill_random, [obj.tensor for obj in sources])
        keys = [ChunkKey(i.to_bytes(DIGEST_SIZE, "little")) for i in range(chunks)]
        runs = []
        for run in range(repeats):
            runs.append(
                await _disk_run(
                    root,
                    run,
                    spec=spec,
                    sealed=sealed,
                    pool=pool,
                    keys=keys,
                    sources=sources,
                    batch=batch,
                    cold=cold,
                )
            )
    finally:
        for obj in sources:
            obj.unref()
        pool.close()

    def median(name: str) -> float:
        return statistics.median(r[name] for r in runs)

    put, raw_write = median("put_gbps"), median("raw_write_gbps")
    get, raw_read = median("get_gbps"), median("raw_read_gbps")
    targets = {**DISK_TARGETS, **(ENCRYPTION_TARGETS if encrypted else {})}
    figures: dict[str, Any] = {}
    if encrypted:
        sealed_put, sealed_get = median("encrypted_put_gbps"), median("encrypted_get_gbps")
        figures = {
            "encrypted_put_gbps": sealed_put,
            "encrypted_put_ratio": sealed_put / put,
            "encrypted_get_gbps": sealed_get,
            "encrypted_get_ratio": sealed_get / get,
        }
    return {
        "tier": "disk",
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "batch": batch,
        "repeats": repeats,
        "cold": cold,
        "reads_from": "device (page cache dropped)" if cold else "page cache (both sides)",
        "put_gbps": put,
        "raw_write_gbps": raw_write,
        "put_ratio": put / raw_write,
        "get_gbps": get,
        "raw_read_gbps": raw_read,
        "get_ratio": get / raw_read,
        **figures,
        "encrypted": encrypted,
        "targets": targets,
        "runs": runs,
    }


async def _disk_run(
    root: Path,
    run: int,
    *,
    spec: RecordSpec,
    sealed: RecordSpec | None,
    pool: MemoryPool,
    keys: list[ChunkKey],
    sources: list[MemoryObj],
    batch: int,
    cold: bool,
) -> dict[str, float]:
    """One run: writes then reads through the tier, the encrypted tier (with ``sealed``)
    and as raw files, taking turns batch by batch; returns GB/s."""
    tier_dir, raw_dir = root / f"tier-{run}", root / f"raw-{run}"
    nbytes = sum(obj.nbytes for obj in sources)
    spans = [(start, min(start + batch, len(keys))) for start in range(0, len(keys), batch)]
    raw_paths = [raw_dir / f"{i:06d}.bin" for i in range(len(keys))]
    views = [obj.data for obj in sources]
    tiers: list[DiskBackend] = []
    scratch = pool.allocate_nowait((min(batch, len(keys)) * views[0].nbytes,), torch.uint8)
    if scratch is None:
        raise InvalidInputError("benchmark pool too small")  # sized by bench_disk: a bug
    try:
        for directory, tier_spec in ((tier_dir, spec), (root / f"sealed-{run}", sealed)):
            if tier_spec is not None:
                tiers.append(
                    await DiskBackend.open(
                        directory,
                        pool=pool,
                        spec=tier_spec,
                        allocation_timeout=30.0,
                        max_local_disk_size=2 * nbytes + (1 << 20),
                    )
                )
        await anyio.to_thread.run_sync(functools.partial(raw_dir.mkdir, parents=True))
        dest = scratch.data

        async def raw_write(lo: int, hi: int) -> None:
            await anyio.to_thread.run_sync(_raw_write, raw_paths[lo:hi], views[lo:hi])

        async def raw_read(lo: int, hi: int) -> None:
            await anyio.to_thread.run_sync(_raw_read, raw_paths[lo:hi], dest)

        puts = [functools.partial(_tier_put, disk, keys, sources) for disk in tiers]
        gets = [functools.partial(_tier_get, disk, keys) for disk in tiers]
        put_s = await interleaved([raw_write, *puts], spans, run)
        if cold:
            tier_files = [disk.path_of(key) for disk in tiers for key in keys]
            await anyio.to_thread.run_sync(_drop_cached, [*tier_files, *raw_paths])
        get_s = await interleaved([raw_read, *gets], spans, run)
        for disk in tiers:  # untimed: each tier hands back exactly the bytes it was given
            for i in dict.fromkeys((0, len(keys) - 1)):
                await _check_exact(disk, keys[i], sources[i])
    finally:
        scratch.unref()
        for disk in tiers:
            await disk.aclose()
        await anyio.to_thread.run_sync(_remove_trees, [tier_dir, root / f"sealed-{run}", raw_dir])
    figures = {
        "put_gbps": gbps(nbytes, put_s[1]),
        "raw_write_gbps": gbps(nbytes, put_s[0]),
        "get_gbps": gbps(nbytes, get_s[1]),
        "raw_read_gbps": gbps(nbytes, get_s[0]),
    }
    if sealed is not None:
        figures["encrypted_put_gbps"] = gbps(nbytes, put_s[2])
        figures["encrypted_get_gbps"] = gbps(nbytes, get_s[2])
    return figures


async def _tier_put(
    disk: DiskBackend, keys: list[ChunkKey], sources: list[MemoryObj], lo: int, hi: int
) -> None:
    await disk.put(keys[lo:hi], sources[lo:hi])


async def _tier_get(disk: DiskBackend, keys: list[ChunkKey], lo: int, hi: int) -> None:
    got = await disk.get(keys[lo:hi])
    for obj in got:
        if obj is not None:
            obj.unref()
    if any(obj is None for obj in got):
        raise TierError("the disk tier lost a chunk during the benchmark")


async def _check_exact(disk: DiskBackend, key: ChunkKey, source: MemoryObj) -> None:
    (obj,) = await disk.get([key])
    if obj is None:
        raise TierError("the disk tier lost a chunk during the benchmark")
    try:
        if not torch.equal(obj.tensor.view(torch.uint8), source.tensor.view(torch.uint8)):
            raise TierError("the disk tier returned other bytes than were put")
    finally:
        obj.unref()


def _raw_write(paths: list[Path], views: list[memoryview]) -> None:
    for path, view in zip(paths, views, strict=True):
        with open(path, "wb") as f:
            f.write(view)


def _raw_read(paths: list[Path], dest: memoryview) -> None:
    offset = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            view = dest[offset : offset + size]
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            offset += size


def _drop_cached(paths: list[Path]) -> None:
    """Write back and evict ``paths`` from the page cache, so reads hit the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _remove_trees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
