"""The CPU tier at one size: an engine whose pool holds N chunks, filled through its own
stores, and what its index costs per chunk (:func:`~lmcache_async.backends.footprint.
measure_cpu_tier`)."""

from __future__ import annotations

import os
import time
from typing import Any

from lmcache_async import CacheEngine
from lmcache_async.backends.footprint import measure_cpu_tier
from lmcache_async.bench.scale.fill import FillProgress
from lmcache_async.bench.scale.options import CHUNK_TOKENS, FILL_PROMPT_CHUNKS, REQUEST_TOKENS
from lmcache_async.bench.scale.requests import MODEL_NAME, ScaleRun, prompt_stream, scale_config
from lmcache_async.bench.scale.resident import resident_in_child
from lmcache_async.memory.pool import page_size_for

__all__ = ["cpu_at_size"]

_SLACK_CHUNKS = 64
"""Chunks of pool beyond the size and what the measured stores add."""


async def cpu_at_size(run: ScaleRun, size: int) -> dict[str, Any]:
    """Open an engine whose pool holds ``size`` chunks and those the measured stores add
    (nothing is evicted), time the open and the
    first RAM hit, fill the tier to ``size`` chunks (the probes first), time the
    requests, and measure the index's bytes per chunk at that size."""
    options, kit, probes, stream = run.options, run.kit, run.probes, run.stream
    page = page_size_for(kit.chunk_bytes)
    chunk_pages = -(-kit.chunk_bytes // page) * page
    stored = (options.probes + 1) * (REQUEST_TOKENS // CHUNK_TOKENS) + _SLACK_CHUNKS
    config = scale_config(run.base, cpu_bytes=(size + stored) * chunk_pages)
    problems: list[str] = []
    row: dict[str, Any] = {"chunks": size}
    start = time.perf_counter()
    async with CacheEngine.open(config, kit.layout, model_name=MODEL_NAME) as engine:
        row["open_s"] = time.perf_counter() - start
        hit = await kit.first_hit(engine, run.first)
        row["first_hit_s"] = time.perf_counter() - start
        if hit != REQUEST_TOKENS:
            problems.append(f"cpu {size}: the first lookup found {hit} of {REQUEST_TOKENS} tokens")
        fill_start = time.perf_counter()
        progress = FillProgress(stream, f"scale cpu {size}: storing", size, "chunks")
        for tokens in probes:
            await kit.store(engine, tokens, ["cpu"])
        filler = prompt_stream(options.seed, "cpu-fill", size)
        held = engine.stats().tiers["cpu"].chunks
        progress.advance(held)
        while held < size:
            chunks = min(FILL_PROMPT_CHUNKS, size - held)
            (tokens,) = kit.prompts(filler, 1, chunks * CHUNK_TOKENS)
            await kit.store(engine, tokens, ["cpu"])
            now = engine.stats().tiers["cpu"].chunks
            if now <= held:
                problems.append(f"cpu {size}: a fill store added nothing at {held} chunks")
                break
            progress.advance(now - held)
            held = now
        row["fill_chunks_per_s"] = progress.finish()
        row["fill_s"] = time.perf_counter() - fill_start
        row["held"] = held
        if held != size:
            problems.append(f"cpu {size}: the tier holds {held} chunks, not {size}")
        fresh = kit.prompts(prompt_stream(options.seed, "cpu-fresh", size), options.probes)
        row["ops"], failed = await kit.measure(
            engine, fresh, probes, store_location=["cpu"], warmup=options.warmup
        )
        problems += [f"cpu {size}: {text}" for text in failed]
        tier = engine.stats().tiers["cpu"]
        if tier.evictions:
            problems.append(f"cpu {size}: {tier.evictions} chunks were evicted")
    footprint = await measure_cpu_tier(
        size,
        chunk_tokens=CHUNK_TOKENS,
        token_bytes=kit.layout.token_bytes,
        events=False,
        seed=options.seed,
    )
    row["index_bytes_per_chunk"] = footprint.overhead_bytes_per_chunk
    row["resident_bytes_per_chunk"] = await resident_in_child(
        size, chunk_tokens=CHUNK_TOKENS, token_bytes=kit.layout.token_bytes
    )
    row["pool_bytes_per_chunk"] = footprint.pool_bytes_per_chunk
    row["loadavg"] = os.getloadavg()
    row["problems"] = problems
    return row
