"""How long the disk tier takes to open, and to index every chunk, at a few sizes.

Usage: ``python scripts/disk_open_scale.py BASE [N ...]`` (default sizes 10k, 51k, 205k).
``BASE/<N>`` is filled once with N record files of 4 KiB chunks (kept for later runs).
For each size, with the page cache warm (a names-only walk first), it prints:

* ``walk_s``: a names-only ``os.scandir`` walk; ``walk_stat_s``: the same with one
  ``stat`` per file; ``read_all_s``: open and read every file;
* ``open_s``: :meth:`DiskBackend.open` until it returns; ``index_s``: until its index is
  complete (``wait_index``; where there is none, the same as ``open_s``), with the
  manifest the previous close wrote; ``audited_s``: until the sizes are checked too;
  ``no_manifest_*``: the first open, without a manifest (every header read);
* ``engine_first_lookup_s``: ``CacheEngine.open`` until a first lookup is answered;
* ``headers_read``: files whose header the fill read (the rest came from the manifest).

Each figure is the best of ``--repeats`` runs. With ``--memory`` the index's bytes per
chunk are measured with tracemalloc over a fill of ``BASE/<first size>``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.backends.disk import DiskBackend
from lmcache_async.backends.disk_file import CHUNK_SUFFIX, record_path
from lmcache_async.engine.tiers import record_spec
from lmcache_async.keys.chunks import DIGEST_SIZE, ChunkKey
from lmcache_async.memory.pool import MemoryPool
from lmcache_async.tenancy.tenants import TAG_BYTES, tenant_tag

CHUNK = 16
LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=4, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16
)  # 4 KiB a full chunk


def config(directory: Path) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        max_local_cpu_size=0.01,
        local_disk=str(directory),
        max_local_disk_size=100.0,
    )


def generate(directory: Path, count: int) -> None:
    """``count`` records of the default tenant (one fan-out directory, as in service)."""
    if directory.exists() and sum(1 for _ in directory.glob(f"*/*{CHUNK_SUFFIX}")) == count:
        return
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    spec = record_spec(config(directory), LAYOUT)
    pool = MemoryPool(1 << 20, pin_memory=False)
    obj = pool.allocate_nowait(LAYOUT.payload_shape(CHUNK), LAYOUT.dtype)
    assert obj is not None
    obj.tensor.view(torch.uint8).copy_(torch.randint(0, 256, obj.tensor.view(torch.uint8).shape))
    tag = tenant_tag(None)
    for i in range(count):
        key = ChunkKey(tag + i.to_bytes(DIGEST_SIZE - TAG_BYTES, "little"))
        head, payload = spec.encode(key, obj)
        path = record_path(directory, key)
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb") as f:
            f.write(head)
            f.write(payload)
    obj.unref()
    pool.close()


def walk(directory: Path, *, stat: bool = False, read: bool = False) -> int:
    n = 0
    with os.scandir(directory) as tops:
        for top in tops:
            if not top.is_dir(follow_symlinks=False):
                continue
            with os.scandir(top.path) as items:
                for item in items:
                    if stat:
                        item.stat()
                    if read:
                        with open(item.path, "rb", buffering=0) as f:
                            f.read()
                    n += 1
    return n


def best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


async def open_disk(directory: Path, pool: MemoryPool) -> DiskBackend:
    return await DiskBackend.open(
        directory,
        pool=pool,
        spec=record_spec(config(directory), LAYOUT),
        allocation_timeout=1.0,
        max_local_disk_size=100 << 30,
    )


async def time_disk(directory: Path) -> tuple[float, float, float, int, int]:
    """Seconds to open, to a complete index, to an audited one; chunks; headers read."""
    pool = MemoryPool(1 << 20, pin_memory=False)
    start = time.perf_counter()
    disk = await open_disk(directory, pool)
    opened = time.perf_counter() - start
    wait = getattr(disk, "wait_index", None)
    if wait is not None:
        await wait()
    indexed = time.perf_counter() - start
    if wait is not None:
        await wait(audited=True)
    audited = time.perf_counter() - start
    stats = getattr(disk, "index_stats", None)
    headers = stats().headers_read if stats is not None else len(disk)
    chunks = len(disk)
    await disk.aclose()
    pool.close()
    return opened, indexed, audited, chunks, headers


async def time_engine(directory: Path) -> float:
    start = time.perf_counter()
    async with CacheEngine.open(config(directory), LAYOUT, model_name="m") as engine:
        await engine.lookup(list(range(4 * CHUNK)))
        return time.perf_counter() - start


async def bytes_per_chunk(directory: Path) -> float:
    pool = MemoryPool(1 << 20, pin_memory=False)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    disk = await open_disk(directory, pool)
    wait = getattr(disk, "wait_index", None)
    if wait is not None:
        await wait(audited=True)
        await anyio.sleep(0.2)  # the fill's thread ends, and what it held goes with it
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    chunks = len(disk)
    await disk.aclose()
    pool.close()
    return (after - before) / chunks


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base", type=Path)
    parser.add_argument("sizes", type=int, nargs="*", default=[10_000, 51_000, 205_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    print(json.dumps({"uptime": os.getloadavg()}), flush=True)
    for n in args.sizes:
        directory = args.base / str(n)
        generate(directory, n)
        walk(directory, read=True)  # warm
        row: dict[str, Any] = {"chunks": n}
        row["walk_s"] = best(lambda d=directory: walk(d), args.repeats)
        row["walk_stat_s"] = best(lambda d=directory: walk(d, stat=True), args.repeats)
        row["read_all_s"] = best(lambda d=directory: walk(d, read=True), args.repeats)
        for manifest in directory.glob("manifest-*"):
            manifest.unlink()  # the first open without one (a full scan), which writes it
        first = await time_disk(directory)
        row["no_manifest_open_s"], row["no_manifest_index_s"] = first[0], first[1]
        runs = [await time_disk(directory) for _ in range(args.repeats)]
        row["open_s"] = min(r[0] for r in runs)
        row["index_s"] = min(r[1] for r in runs)
        row["audited_s"] = min(r[2] for r in runs)
        row["indexed"] = runs[-1][3]
        row["headers_read"] = [first[4]] + [r[4] for r in runs]
        if not args.no_engine:
            row["engine_first_lookup_s"] = min(
                [await time_engine(directory) for _ in range(args.repeats)]
            )
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
        sys.stdout.flush()
    if args.memory:
        directory = args.base / str(args.sizes[0])
        print(json.dumps({"bytes_per_chunk": round(await bytes_per_chunk(directory), 1)}))


if __name__ == "__main__":
    anyio.run(main)
