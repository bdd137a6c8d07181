"""The disk tier's put and get GB/s next to plain file writes and reads of the same bytes."""

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

from lmcache_async import ChunkKey, InvalidInputError
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.record import RecordSpec, tensor_bytes
from lmcache_async.bench import gbps
from lmcache_async.bench.tiers.common import (
    BENCH_DTYPE,
    BENCH_TOKENS,
    CHUNK_GRANULE,
    bench_spec,
    check_count,
    fill_random,
    interleaved,
)
from lmcache_async.memory import DEFAULT_PAGE_SIZE, MemoryObj, MemoryPool

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
) -> dict[str, Any]:
    """Disk tier put/get GB/s against raw file writes/reads of the same bytes.

    Each run writes ``chunks`` chunks of ``chunk_bytes`` (random bytes) through a fresh
    tier and as plain files, ``batch`` chunks per call, then reads them all back; its files
    are deleted afterwards. Subdirectories ``tier-<run>`` and ``raw-<run>`` of
    ``directory`` are used.

    Returns:
        ``put_gbps``, ``raw_write_gbps``, ``put_ratio``, ``get_gbps``, ``raw_read_gbps``,
        ``get_ratio`` (medians over runs), the settings, the targets and ``runs`` (every
        run's figures).

    Raises:
        InvalidInputError: a count is not a positive int, or ``chunk_bytes`` is not a
            multiple of 1024.
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
        keys = [ChunkKey(i.to_bytes(16, "little")) for i in range(chunks)]
        runs = []
        for run in range(repeats):
            runs.append(
                await _disk_run(
                    root,
                    run,
                    spec=spec,
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
        "targets": dict(DISK_TARGETS),
        "runs": runs,
    }


async def _disk_run(
    root: Path,
    run: int,
    *,
    spec: RecordSpec,
    pool: MemoryPool,
    keys: list[ChunkKey],
    sources: list[MemoryObj],
    batch: int,
    cold: bool,
) -> dict[str, float]:
    """One run: writes then reads through the tier and as raw files; returns GB/s."""
    tier_dir, raw_dir = root / f"tier-{run}", root / f"raw-{run}"
    nbytes = sum(obj.nbytes for obj in sources)
    spans = [(start, min(start + batch, len(keys))) for start in range(0, len(keys), batch)]
    raw_paths = [raw_dir / f"{i:06d}.bin" for i in range(len(keys))]
    views = [tensor_bytes(obj.tensor) for obj in sources]
    disk = await DiskBackend.open(
        tier_dir,
        pool=pool,
        spec=spec,
        allocation_timeout=30.0,
        max_local_disk_size=2 * nbytes + (1 << 20),
    )
    scratch = pool.allocate_nowait((min(batch, len(keys)) * views[0].nbytes,), torch.uint8)
    if scratch is None:
        raise InvalidInputError("benchmark pool too small")  # sized by bench_disk: a bug
    try:
        await anyio.to_thread.run_sync(functools.partial(raw_dir.mkdir, parents=True))
        dest = tensor_bytes(scratch.tensor)

        async def tier_put(lo: int, hi: int) -> None:
            await disk.put(keys[lo:hi], sources[lo:hi])

        async def raw_write(lo: int, hi: int) -> None:
            await anyio.to_thread.run_sync(_raw_write, raw_paths[lo:hi], views[lo:hi])

        async def tier_get(lo: int, hi: int) -> None:
            got = await disk.get(keys[lo:hi])
            for obj in got:
                if obj is None:
                    raise InvalidInputError("disk tier lost a chunk during the benchmark")
                obj.unref()

        async def raw_read(lo: int, hi: int) -> None:
            await anyio.to_thread.run_sync(_raw_read, raw_paths[lo:hi], dest)

        put_s, raw_write_s = await interleaved(tier_put, raw_write, spans, run)
        if cold:
            tier_files = [disk.path_of(key) for key in keys]
            await anyio.to_thread.run_sync(_drop_cached, [*tier_files, *raw_paths])
        get_s, raw_read_s = await interleaved(tier_get, raw_read, spans, run)
    finally:
        scratch.unref()
        await disk.aclose()
        await anyio.to_thread.run_sync(_remove_trees, [tier_dir, raw_dir])
    return {
        "put_gbps": gbps(nbytes, put_s),
        "raw_write_gbps": gbps(nbytes, raw_write_s),
        "get_gbps": gbps(nbytes, get_s),
        "raw_read_gbps": gbps(nbytes, raw_read_s),
    }


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
