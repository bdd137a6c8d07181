"""A fresh engine's first store against its steady-state store, with and without the pool
faulted in behind the start (``prefault_pool``).

Usage: ``python scripts/prefault_first_store.py [--trials N] [--pool-mib M]``.

Each trial opens a new engine (a new arena, so fresh pages), stores one 24 MiB prompt (the
*first* store), then clears and stores it again a few times into the same, now resident,
pages (the *steady* stores, their median). Modes:

* ``off``: ``prefault_pool=False``, pages faulted in by the store itself;
* ``on``: ``prefault_pool=True``, the store issued right after ``open`` returns (racing the
  worker, which starts at the arena's first page);
* ``on_done``: as ``on``, after waiting for the worker to finish.

It prints, per mode, the median first and steady store times and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.config import GB

LAYOUT = KVLayout.vllm_flash_attn(
    num_layers=8, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16
)
TOKENS = 768  # 8 layers x K and V x 8 heads x 128 x fp16 = 32 KiB a token: 24 MiB
STEADY_STORES = 5


async def trial(mode: str, pool_bytes: int, source: list[torch.Tensor]) -> tuple[float, float]:
    """One fresh engine: (first store seconds, median steady store seconds)."""
    config = EngineConfig(
        chunk_size=256, max_local_cpu_size=pool_bytes / GB, prefault_pool=mode != "off"
    )
    prompt = list(range(1, TOKENS + 1))
    slots = torch.arange(TOKENS, dtype=torch.int64)
    async with CacheEngine.open(config, LAYOUT, model_name="m") as engine:
        worker = engine.core.pool.prefaulting
        if mode == "on_done" and worker is not None:
            await anyio.to_thread.run_sync(worker.join, 60.0)
        began = time.perf_counter()
        assert await engine.store(prompt, kv_caches=source, slot_mapping=slots) == TOKENS
        first = time.perf_counter() - began
        steady = []
        for _ in range(STEADY_STORES):
            await engine.clear()
            began = time.perf_counter()
            assert await engine.store(prompt, kv_caches=source, slot_mapping=slots) == TOKENS
            steady.append(time.perf_counter() - began)
    return first, statistics.median(steady)


async def main(trials: int, pool_bytes: int) -> None:
    blocks = TOKENS // 16
    source = LAYOUT.allocate_kv_caches(
        blocks, generator=torch.Generator().manual_seed(0), random=True
    )
    modes = ("off", "on", "on_done")
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    await trial("off", pool_bytes, source)  # warm-up: imports, thread pools, code paths
    for _ in range(trials):
        for mode in modes:  # interleaved, so a noisy neighbour hits every mode alike
            results[mode].append(await trial(mode, pool_bytes, source))
    print(f"store of {TOKENS * 32 // 1024} MiB, pool {pool_bytes >> 20} MiB, {trials} trials")
    print(f"{'mode':<8} {'first_ms':>9} {'steady_ms':>10} {'ratio':>6}")
    for mode in modes:
        first = statistics.median(f for f, _ in results[mode])
        steady = statistics.median(s for _, s in results[mode])
        print(f"{mode:<8} {first * 1e3:9.2f} {steady * 1e3:10.2f} {first / steady:6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--pool-mib", type=int, default=256)
    args = parser.parse_args()
    anyio.run(main, args.trials, args.pool_mib << 20)
