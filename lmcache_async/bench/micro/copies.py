"""Store and retrieve GB/s, and a short request's overhead, next to the plain copies."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.bench.baselines import (
    cache_gb,
    copy_entry,
    gather_rows,
    row_views,
    scatter_rows,
    slots_over,
    timed,
)
from lmcache_async.bench.micro.options import TARGETS, VOCAB, WARMUP, MicroOptions

__all__ = ["copy_bench"]


async def _engine_warmup(
    engine: CacheEngine,
    tokens: torch.Tensor,
    kv: list[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """An untimed store and retrieve of the request, then an empty cache: what comes
    between the raw copies and the next timed engine request.

    A raw copy runs on torch's OpenMP threads, which keep spinning for several
    milliseconds after it: an engine request timed at once would share the two cores with
    them (on this kind of machine a 1k-token store took 12.6-13.4 ms right after the raw
    copies, 9.4-9.5 ms 20 ms later). A pause instead would leave the engine to start cold
    where the raw copies, timed right after it, start warm (idle or busy elsewhere for a
    few milliseconds, a small store's validation here takes four times as long). This
    request runs through the spinning, and the timed one then starts as warm as the raw
    copies do.
    """
    await engine.clear()
    await engine.store(tokens, kv_caches=kv, slot_mapping=src)
    await engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst)
    await engine.clear()


async def _atimed(fn: Callable[[], Awaitable[object]]) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = await fn()
    return time.perf_counter() - t0, result


async def copy_bench(
    options: MicroOptions, config: EngineConfig, layout: KVLayout, gen: torch.Generator
) -> dict[str, Any]:
    """Store/retrieve throughput and per-request overhead against the raw copies."""
    num_tokens = options.tokens
    bs = options.block_size
    blocks_needed = math.ceil(num_tokens / bs)
    num_blocks = 2 * blocks_needed
    kv = layout.allocate_kv_caches(num_blocks, generator=gen, random=True)
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int64)
    src_blocks, dst_blocks = perm[:blocks_needed], perm[blocks_needed:]
    src_slots = slots_over(src_blocks, bs, num_tokens)
    dst_slots = slots_over(dst_blocks, bs, num_tokens)
    tokens = torch.randint(0, VOCAB, (num_tokens,), generator=gen, dtype=torch.int64)
    views = row_views(layout, kv)
    buf = torch.empty(layout.payload_shape(num_tokens), dtype=layout.dtype)
    nbytes = num_tokens * layout.token_bytes
    cfg = config.replace(local_cpu=True, max_local_cpu_size=cache_gb(nbytes))

    times: dict[str, list[float]] = {
        "store": [],
        "raw_gather": [],
        "retrieve": [],
        "raw_scatter": [],
    }
    problems: list[str] = []
    async with CacheEngine.open(cfg, layout, model_name="lmcache-async-micro") as engine:
        # Engine and raw runs alternate, so a change in the machine's speed during the
        # measurement weighs on both alike (see _engine_warmup for what comes between).
        for run in range(WARMUP + options.repeat):
            measured = run >= WARMUP
            await _engine_warmup(engine, tokens, kv, src_slots, dst_slots)
            t_store, stored = await _atimed(
                lambda: engine.store(tokens, kv_caches=kv, slot_mapping=src_slots)
            )
            if stored != num_tokens:
                problems.append(f"store returned {stored} of {num_tokens} tokens")
            t_retrieve, mask = await _atimed(
                lambda: engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst_slots)
            )
            if not isinstance(mask, torch.Tensor) or not bool(mask.all()):
                problems.append("retrieve did not load every token")
            t_gather = timed(lambda: gather_rows(views, src_slots, buf))
            t_scatter = timed(lambda: scatter_rows(views, dst_slots, buf))
            if measured:
                times["store"].append(t_store)
                times["retrieve"].append(t_retrieve)
                times["raw_gather"].append(t_gather)
                times["raw_scatter"].append(t_scatter)

        # Bit-exactness, outside the timings: blank the destination, load it, compare.
        for layer in kv:
            layer.index_fill_(1, dst_blocks, 0)
        await engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst_slots)
        expected = torch.empty_like(buf)
        gather_rows(views, src_slots, expected)
        gather_rows(views, dst_slots, buf)
        verified = torch.equal(expected.view(torch.uint8), buf.view(torch.uint8))
        if not verified:
            problems.append("retrieved KV differs from the stored KV")
        del expected

        overhead = await _overhead_bench(
            options,
            engine=engine,
            layout=layout,
            kv=kv,
            tokens=tokens,
            src_slots=src_slots,
            dst_slots=dst_slots,
        )

    ratio = TARGETS["copy_ratio"]
    return {
        "tokens": num_tokens,
        "bytes": nbytes,
        "runs": options.repeat,
        "store": copy_entry(nbytes, times["store"], times["raw_gather"], target_ratio=ratio),
        "retrieve": copy_entry(nbytes, times["retrieve"], times["raw_scatter"], target_ratio=ratio),
        "verified_bit_exact": verified,
        "overhead": overhead,
        "problems": problems,
    }


async def _overhead_bench(
    options: MicroOptions,
    *,
    engine: CacheEngine,
    layout: KVLayout,
    kv: list[torch.Tensor],
    tokens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> dict[str, Any]:
    """Engine time minus raw copy time of one short store and retrieve, in microseconds."""
    n = options.overhead_tokens
    toks, src, dst = tokens[:n].clone(), src_slots[:n].clone(), dst_slots[:n].clone()
    views = row_views(layout, kv)
    buf = torch.empty(layout.payload_shape(n), dtype=layout.dtype)
    chunk = engine.config.chunk_size
    bounds = [(start, min(start + chunk, n)) for start in range(0, n, chunk)]
    chunk_bufs = [torch.empty(layout.payload_shape(e - s), dtype=layout.dtype) for s, e in bounds]
    src_parts = [src[s:e].clone() for s, e in bounds]
    dst_parts = [dst[s:e].clone() for s, e in bounds]

    def chunk_gather() -> None:
        for rows, out in zip(src_parts, chunk_bufs, strict=True):
            gather_rows(views, rows, out)

    def chunk_scatter() -> None:
        for rows, payload in zip(dst_parts, chunk_bufs, strict=True):
            scatter_rows(views, rows, payload)

    times: dict[str, list[float]] = {
        "store": [],
        "raw_gather": [],
        "raw_chunk_gather": [],
        "retrieve": [],
        "raw_scatter": [],
        "raw_chunk_scatter": [],
    }
    # Engine and raw runs alternate, as in copy_bench.
    for run in range(2 + options.overhead_iterations):
        await _engine_warmup(engine, toks, kv, src, dst)
        t_store, _ = await _atimed(lambda: engine.store(toks, kv_caches=kv, slot_mapping=src))
        t_retrieve, _ = await _atimed(lambda: engine.retrieve(toks, kv_caches=kv, slot_mapping=dst))
        measured = {
            "store": t_store,
            "retrieve": t_retrieve,
            "raw_chunk_gather": timed(chunk_gather),
            "raw_chunk_scatter": timed(chunk_scatter),
            "raw_gather": timed(lambda: gather_rows(views, src, buf)),
            "raw_scatter": timed(lambda: scatter_rows(views, dst, buf)),
        }
        if run >= 2:
            for name, seconds in measured.items():
                times[name].append(seconds)
    med = {name: statistics.median(values) * 1e6 for name, values in times.items()}
    return {
        "tokens": n,
        "chunks": len(bounds),
        "iterations": options.overhead_iterations,
        "store_engine_us": med["store"],
        "store_raw_us": med["raw_chunk_gather"],
        "store_overhead_us": med["store"] - med["raw_chunk_gather"],
        "store_raw_whole_us": med["raw_gather"],
        "retrieve_engine_us": med["retrieve"],
        "retrieve_raw_us": med["raw_chunk_scatter"],
        "retrieve_overhead_us": med["retrieve"] - med["raw_chunk_scatter"],
        "retrieve_raw_whole_us": med["raw_scatter"],
        "target_us": TARGETS["overhead_us"],
    }
