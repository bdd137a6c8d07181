"""A small request's latency: a 1k-token store and retrieve of a tiny model, whose copies
are a few KiB, so that what is measured is the engine's per-request cost."""

from __future__ import annotations

import functools
import math
from typing import Any, Final

import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.bench import percentiles
from lmcache_async.bench.baselines import (
    cache_gb,
    gather_rows,
    row_views,
    scatter_rows,
    slots_over,
    timed,
)
from lmcache_async.bench.micro.copies import atimed
from lmcache_async.bench.micro.options import (
    SMALL_CHUNK,
    SMALL_SHAPE,
    TARGETS,
    VOCAB,
    MicroOptions,
)
from lmcache_async.memory.pool import DEFAULT_PAGE_SIZE

__all__ = ["ROUND", "small_bench"]

ROUND: Final = 25
"""Requests per round: the engine's requests of a round run back to back, then as many of
each raw copy; the first round is warm-up."""


async def small_bench(
    options: MicroOptions, config: EngineConfig, gen: torch.Generator
) -> dict[str, Any]:
    """p50 and p99 of a ``overhead_tokens`` store and retrieve of :data:`SMALL_SHAPE`
    (chunk :data:`SMALL_CHUNK`), beside one raw copy of the same rows.

    Each request stores a prompt not seen before (so that the store copies) and then
    retrieves it into other blocks (checked to load every token), with the same KV caches
    from request to request, as a serving engine does. The raw copies are the plainest
    copy of the request's rows: per layer and K/V one ``index_select`` of all of them into
    one buffer (``index_copy_`` back); the same per chunk is printed beside them as the
    cost of chunking.

    The engine's requests and the raw copies take turns by rounds of :data:`ROUND`, not
    request by request: a raw copy leaves torch's OpenMP threads spinning, which would
    weigh on the engine request timed right after it. The cache is emptied between rounds.
    """
    n = options.overhead_tokens
    bs = options.block_size
    layout = SMALL_SHAPE.layout(bs)
    blocks_needed = math.ceil(n / bs)
    num_blocks = 2 * blocks_needed
    kv = layout.allocate_kv_caches(num_blocks, generator=gen, random=True)
    perm = torch.randperm(num_blocks, generator=gen, dtype=torch.int64)
    dst_blocks = perm[blocks_needed:]
    src = slots_over(perm[:blocks_needed], bs, n)
    dst = slots_over(dst_blocks, bs, n)
    rounds = 1 + math.ceil(options.overhead_iterations / ROUND)
    prompts = torch.randint(0, VOCAB, (rounds * ROUND, n), generator=gen, dtype=torch.int64)

    views = row_views(layout, kv)
    buf = torch.empty(layout.payload_shape(n), dtype=layout.dtype)
    bounds = [(start, min(start + SMALL_CHUNK, n)) for start in range(0, n, SMALL_CHUNK)]
    chunk_bufs = [torch.empty(layout.payload_shape(e - s), dtype=layout.dtype) for s, e in bounds]
    src_parts = [src[s:e].clone() for s, e in bounds]
    dst_parts = [dst[s:e].clone() for s, e in bounds]

    def chunk_gather() -> None:
        for rows, out in zip(src_parts, chunk_bufs, strict=True):
            gather_rows(views, rows, out)

    def chunk_scatter() -> None:
        for rows, payload in zip(dst_parts, chunk_bufs, strict=True):
            scatter_rows(views, rows, payload)

    # A round's prompts, each chunk taking whole pages of the pool.
    chunk_bytes = -(-SMALL_CHUNK * layout.token_bytes // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
    round_bytes = ROUND * len(bounds) * chunk_bytes
    cfg = config.replace(
        chunk_size=SMALL_CHUNK, local_cpu=True, max_local_cpu_size=cache_gb(round_bytes)
    )
    names = ("store", "retrieve", "raw_gather", "raw_scatter")
    times: dict[str, list[float]] = {
        name: [] for name in (*names, "raw_chunk_gather", "raw_chunk_scatter")
    }
    short_stores = short_retrieves = 0
    async with CacheEngine.open(cfg, layout, model_name="lmcache-async-micro-small") as engine:
        for r in range(rounds):
            measured = r > 0
            for i in range(ROUND):
                tokens = prompts[r * ROUND + i]
                t_store, stored = await atimed(
                    functools.partial(engine.store, tokens, kv_caches=kv, slot_mapping=src)
                )
                t_retrieve, mask = await atimed(
                    functools.partial(engine.retrieve, tokens, kv_caches=kv, slot_mapping=dst)
                )
                short_stores += stored != n
                short_retrieves += not isinstance(mask, torch.Tensor) or not bool(mask.all())
                if measured:
                    times["store"].append(t_store)
                    times["retrieve"].append(t_retrieve)
            for _ in range(ROUND):
                raw_s = {
                    "raw_gather": timed(lambda: gather_rows(views, src, buf)),
                    "raw_scatter": timed(lambda: scatter_rows(views, dst, buf)),
                    "raw_chunk_gather": timed(chunk_gather),
                    "raw_chunk_scatter": timed(chunk_scatter),
                }
                if measured:
                    for name, seconds in raw_s.items():
                        times[name].append(seconds)
            await engine.clear()

        # Bit-exactness, outside the timings: blank the destination, load it, compare.
        await engine.store(prompts[0], kv_caches=kv, slot_mapping=src)
        for layer in kv:
            layer.index_fill_(1, dst_blocks, 0)
        await engine.retrieve(prompts[0], kv_caches=kv, slot_mapping=dst)
        expected = torch.empty_like(buf)
        gather_rows(views, src, expected)
        gather_rows(views, dst, buf)
        verified = torch.equal(expected.view(torch.uint8), buf.view(torch.uint8))

    problems: list[str] = []
    if short_stores:
        problems.append(f"small: {short_stores} stores stored fewer than {n} tokens")
    if short_retrieves:
        problems.append(f"small: {short_retrieves} retrieves did not load every token")
    if not verified:
        problems.append("small: retrieved KV differs from the stored KV")
    ms = {name: percentiles([t * 1e3 for t in values], (50, 99)) for name, values in times.items()}
    target = TARGETS["small_p50_ms"]
    out: dict[str, Any] = {
        "shape": SMALL_SHAPE.label,
        "token_bytes": layout.token_bytes,
        "tokens": n,
        "chunk_size": SMALL_CHUNK,
        "chunks": len(bounds),
        "iterations": len(times["store"]),
        "warmup": ROUND,
        "raw_calls": 2 * SMALL_SHAPE.num_layers,
        "raw_copy": (
            f"one index_select (store) / index_copy_ (retrieve) of all {n} rows per layer "
            f"and K/V: {2 * SMALL_SHAPE.num_layers} calls"
        ),
        "target_p50_ms": target,
        "times_s": times,
        "verified_bit_exact": verified,
        "problems": problems,
    }
    for name, raw in (("store", "gather"), ("retrieve", "scatter")):
        engine_ms, raw_ms, chunk_ms = ms[name], ms[f"raw_{raw}"], ms[f"raw_chunk_{raw}"]
        out[name] = {
            "p50_ms": engine_ms["p50"],
            "p99_ms": engine_ms["p99"],
            "raw_p50_ms": raw_ms["p50"],
            "raw_p99_ms": raw_ms["p99"],
            "raw_chunks_p50_ms": chunk_ms["p50"],
            "ratio": engine_ms["p50"] / raw_ms["p50"],
            "overhead_ms": engine_ms["p50"] - raw_ms["p50"],
            "ok": engine_ms["p50"] <= target,
        }
    return out
