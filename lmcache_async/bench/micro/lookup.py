"""Lookup latency of a fully cached long prompt: asked again, and seen for the first time."""

from __future__ import annotations

import math
import time
from typing import Any, Final

import torch

from lmcache_async import CacheEngine, EngineConfig, KVLayout
from lmcache_async.bench import parse_dtype, percentiles
from lmcache_async.bench.baselines import cache_gb, slots_over
from lmcache_async.bench.micro.options import TARGETS, VOCAB, MicroOptions
from lmcache_async.memory.pool import DEFAULT_PAGE_SIZE

__all__ = ["lookup_bench"]

_LOOKUP_WARMUP: Final = 20
# Prompts stored for the first-sight lookups (more than the engine's digest memo holds),
# and how many of the oldest are looked up.
_FRESH_PROMPTS: Final = 48
_FRESH_MEASURED: Final = 16


async def lookup_bench(
    options: MicroOptions, config: EngineConfig, gen: torch.Generator
) -> dict[str, Any]:
    """Latency of a fully cached ``lookup_tokens`` prompt, as a tensor and as a list."""
    n = options.lookup_tokens
    bs = options.block_size
    # Lookup cost does not depend on the payload size: a one-layer, 8-wide model will do.
    tiny = KVLayout.vllm_flash_attn(
        num_layers=1, block_size=bs, num_kv_heads=1, head_size=8, dtype=parse_dtype(options.dtype)
    )
    num_blocks = math.ceil(n / bs)
    kv = tiny.allocate_kv_caches(num_blocks, generator=gen, random=True)
    slots = slots_over(torch.arange(num_blocks, dtype=torch.int64), bs, n)
    as_tensor = torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int64)
    as_list = as_tensor.tolist()
    # Each chunk takes whole pages of the pool: size it by pages, not payload bytes.
    chunk_bytes = config.chunk_size * tiny.token_bytes
    chunk_pages = -(-chunk_bytes // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
    prompt_bytes = math.ceil(n / config.chunk_size) * chunk_pages
    cfg = config.replace(
        local_cpu=True, max_local_cpu_size=cache_gb(prompt_bytes * (_FRESH_PROMPTS + 1))
    )
    out: dict[str, Any] = {"tokens": n, "iterations": options.lookup_iterations}
    problems: list[str] = []
    async with CacheEngine.open(cfg, tiny, model_name="lmcache-async-micro-lookup") as engine:
        stored = await engine.store(as_tensor, kv_caches=kv, slot_mapping=slots)
        if stored != n:
            problems.append(f"lookup prompt: store returned {stored} of {n} tokens")
        prompts: dict[str, torch.Tensor | list[int]] = {"tensor": as_tensor, "list": as_list}
        for name, prompt in prompts.items():
            latencies = []
            for i in range(_LOOKUP_WARMUP + options.lookup_iterations):
                t0 = time.perf_counter()
                hit = await engine.lookup(prompt)
                dt = time.perf_counter() - t0
                if hit != n:
                    problems.append(f"lookup ({name}) hit {hit} of {n} tokens")
                    break
                if i >= _LOOKUP_WARMUP:
                    latencies.append(dt * 1e3)
            stat = percentiles(latencies, (50, 99))
            out[name] = {
                "p50_ms": stat["p50"],
                "p99_ms": stat["p99"],
                "ok": stat["p50"] <= TARGETS["lookup_p50_ms"],
            }
        # The engine remembers the digests of its most recent long prompts, so the figures
        # above are for a prompt asked about again. A prompt seen for the first time is
        # hashed in full: store more prompts than it remembers, then look up the oldest.
        fresh = [
            torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.int64)
            for _ in range(_FRESH_PROMPTS)
        ]
        for prompt_tensor in fresh:
            await engine.store(prompt_tensor, kv_caches=kv, slot_mapping=slots)
        latencies = []
        for prompt_tensor in fresh[:_FRESH_MEASURED]:
            t0 = time.perf_counter()
            hit = await engine.lookup(prompt_tensor)
            latencies.append((time.perf_counter() - t0) * 1e3)
            if hit != n:
                problems.append(f"lookup (first sight) hit {hit} of {n} tokens")
        stat = percentiles(latencies, (50, 99))
        out["tensor_first_sight"] = {
            "p50_ms": stat["p50"],
            "p99_ms": stat["p99"],
            "ok": stat["p50"] <= TARGETS["lookup_p50_ms"],
        }
    out["target_p50_ms"] = TARGETS["lookup_p50_ms"]
    out["problems"] = problems
    return out
