"""Store and retrieve GB/s of a long request next to the plain copies of the same bytes."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.bench.baselines import (
    cache_gb,
    copy_entry,
    gather_rows,
    plain_copy,
    plain_entry,
    row_views,
    scatter_rows,
    slots_over,
    timed,
)
from lmcache_async.bench.micro.options import TARGETS, VOCAB, WARMUP, MicroOptions, Shape

__all__ = ["atimed", "copy_bench"]


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


async def atimed(fn: Callable[[], Awaitable[object]]) -> tuple[float, object]:
    """Seconds of ``await fn()``, and what it returned."""
    t0 = time.perf_counter()
    result = await fn()
    return time.perf_counter() - t0, result


async def copy_bench(
    options: MicroOptions, config: EngineConfig, shape: Shape, gen: torch.Generator
) -> dict[str, Any]:
    """GB/s of a store and a retrieve of ``options.tokens`` tokens of ``shape``, the KV
    caches the same from request to request, beside the raw ``index_select`` gather and
    ``index_copy_`` scatter of the same rows and a plain contiguous ``copy_`` of as many
    bytes; then the retrieved KV checked bit for bit."""
    layout = shape.layout(options.block_size)
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
    plain_dst = torch.empty_like(buf)
    nbytes = num_tokens * layout.token_bytes
    cfg = config.replace(local_cpu=True, max_local_cpu_size=cache_gb(nbytes))

    names = ("store", "retrieve", "raw_gather", "raw_scatter", "plain_copy")
    times: dict[str, list[float]] = {name: [] for name in names}
    problems: list[str] = []
    async with CacheEngine.open(cfg, layout, model_name="lmcache-async-micro") as engine:
        # Engine and raw runs alternate, so a change in the machine's speed during the
        # measurement weighs on both alike (see _engine_warmup for what comes between).
        for run in range(WARMUP + options.repeat):
            await _engine_warmup(engine, tokens, kv, src_slots, dst_slots)
            t_store, stored = await atimed(
                lambda: engine.store(tokens, kv_caches=kv, slot_mapping=src_slots)
            )
            if stored != num_tokens:
                problems.append(f"{shape.label}: store returned {stored} of {num_tokens} tokens")
            t_retrieve, mask = await atimed(
                lambda: engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst_slots)
            )
            if not isinstance(mask, torch.Tensor) or not bool(mask.all()):
                problems.append(f"{shape.label}: retrieve did not load every token")
            measured = {
                "store": t_store,
                "retrieve": t_retrieve,
                "raw_gather": timed(lambda: gather_rows(views, src_slots, buf)),
                "raw_scatter": timed(lambda: scatter_rows(views, dst_slots, buf)),
                "plain_copy": timed(lambda: plain_copy(buf, plain_dst)),
            }
            if run >= WARMUP:
                for name, seconds in measured.items():
                    times[name].append(seconds)

        # Bit-exactness, outside the timings: blank the destination, load it, compare.
        for layer in kv:
            layer.index_fill_(1, dst_blocks, 0)
        await engine.retrieve(tokens, kv_caches=kv, slot_mapping=dst_slots)
        expected = plain_dst  # free again: the copy's destination holds what is expected
        gather_rows(views, src_slots, expected)
        gather_rows(views, dst_slots, buf)
        verified = torch.equal(expected.view(torch.uint8), buf.view(torch.uint8))
        if not verified:
            problems.append(f"{shape.label}: retrieved KV differs from the stored KV")

    raw_ratio, plain_ratio = TARGETS["copy_raw_ratio"], TARGETS["copy_plain_ratio"]
    entries: dict[str, dict[str, Any]] = {}
    for name, raw in (("store", "raw_gather"), ("retrieve", "raw_scatter")):
        entry = copy_entry(nbytes, times[name], times[raw], target_ratio=raw_ratio)
        plain = plain_entry(nbytes, times[name], times["plain_copy"], target_ratio=plain_ratio)
        entries[name] = {**entry, **plain}
    return {
        "shape": shape.label,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_size": shape.head_size,
        "dtype": shape.dtype,
        "token_bytes": layout.token_bytes,
        "tokens": num_tokens,
        "bytes": nbytes,
        "runs": options.repeat,
        "times_s": times,
        **entries,
        "verified_bit_exact": verified,
        "problems": problems,
    }
