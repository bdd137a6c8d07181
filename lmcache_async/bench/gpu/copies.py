"""Store (D2H) and retrieve (H2D) GB/s next to plain pinned copies of the same bytes."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from lmcache_async import CacheEngine
from lmcache_async.bench import gbps
from lmcache_async.bench.baselines import (
    copy_entry,
    gather_rows,
    row_views,
    scatter_rows,
    synchronize,
    timed,
)
from lmcache_async.bench.gpu.options import TARGETS, WARMUP
from lmcache_async.bench.gpu.scene import Scene, atimed

__all__ = ["copy_bench"]


async def copy_bench(engine: CacheEngine, scene: Scene, repeat: int) -> dict[str, Any]:
    """Store (D2H) and retrieve (H2D) GB/s against plain pinned copies of the same bytes."""
    device, layout = scene.device, scene.layout
    num_tokens = int(scene.tokens.shape[0])
    views = row_views(layout, scene.kv)
    shape = layout.payload_shape(num_tokens)
    cuda = device.type == "cuda"
    host = torch.empty(shape, dtype=layout.dtype, pin_memory=cuda)
    staging = torch.empty(shape, dtype=layout.dtype, device=device)

    # On the CPU the plain copies gather into and scatter from the host tensor directly:
    # there is no bus to cross.
    def raw_d2h() -> None:
        if cuda:
            gather_rows(views, scene.src_slots, staging)
            host.copy_(staging, non_blocking=True)
        else:
            gather_rows(views, scene.src_slots, host)

    def raw_h2d() -> None:
        if cuda:
            staging.copy_(host, non_blocking=True)
            scatter_rows(views, scene.dst_slots, staging)
        else:
            scatter_rows(views, scene.dst_slots, host)

    def memcpy_d2h() -> None:
        host.copy_(staging, non_blocking=True)

    def memcpy_h2d() -> None:
        staging.copy_(host, non_blocking=True)

    times: dict[str, list[float]] = {
        name: [] for name in ("store", "raw_d2h", "retrieve", "raw_h2d", "memcpy_d2h", "memcpy_h2d")
    }
    problems: list[str] = []
    stored: list[int] = []
    masks: list[torch.Tensor] = []

    async def store() -> None:
        stored.append(
            await engine.store(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.src_slots)
        )

    async def retrieve() -> None:
        masks.append(
            await engine.retrieve(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.dst_slots)
        )

    # Engine and baseline take turns within each run, so that clocks and other load on the
    # machine weigh on both alike.
    for run in range(WARMUP + repeat):
        await engine.clear()
        sample = {
            "store": await atimed(device, store),
            "raw_d2h": timed(raw_d2h, device),
            "retrieve": await atimed(device, retrieve),
            "raw_h2d": timed(raw_h2d, device),
            "memcpy_d2h": timed(memcpy_d2h, device),
            "memcpy_h2d": timed(memcpy_h2d, device),
        }
        if run >= WARMUP:
            for name, seconds in sample.items():
                times[name].append(seconds)
    if any(n != num_tokens for n in stored):
        problems.append(f"store returned {min(stored)} of {num_tokens} tokens")
    if not all(bool(mask.all()) for mask in masks):
        problems.append("retrieve did not load every token")

    # Bit-exactness, outside the timings: blank the destination, load it, compare.
    scene.blank_destination()
    await engine.retrieve(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.dst_slots)
    synchronize(device)
    verified = scene.destination_matches_source()
    if not verified:
        problems.append("retrieved KV differs from the stored KV")
    nbytes = scene.nbytes
    ratio = TARGETS["copy_ratio"]
    return {
        "tokens": num_tokens,
        "bytes": nbytes,
        "runs": repeat,
        "d2h": copy_entry(nbytes, times["store"], times["raw_d2h"], target_ratio=ratio),
        "h2d": copy_entry(nbytes, times["retrieve"], times["raw_h2d"], target_ratio=ratio),
        "memcpy_d2h_gbps": gbps(nbytes, statistics.median(times["memcpy_d2h"])),
        "memcpy_h2d_gbps": gbps(nbytes, statistics.median(times["memcpy_h2d"])),
        "verified_bit_exact": verified,
        "problems": problems,
    }
