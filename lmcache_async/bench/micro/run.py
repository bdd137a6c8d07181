"""A whole micro-benchmark run: hashing, lookups, a small request, then the copies."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

import anyio
import torch

from lmcache_async import EngineConfig
from lmcache_async.bench.micro.copies import copy_bench
from lmcache_async.bench.micro.hashing import hash_bench
from lmcache_async.bench.micro.lookup import lookup_bench
from lmcache_async.bench.micro.machine import cpu_sample, other_work
from lmcache_async.bench.micro.options import WARMUP, WIDE_SHAPE, MicroOptions
from lmcache_async.bench.micro.small import ROUND, small_bench

__all__ = ["run_micro", "run_micro_async"]


async def run_micro_async(options: MicroOptions, config: EngineConfig) -> dict[str, Any]:
    """Run every micro-benchmark and return the figures as plain data.

    The engine configuration is used as given except for ``local_cpu`` (on),
    ``max_local_cpu_size`` (sized to the benchmark, to bound memory) and, for the small
    request, ``chunk_size``. The copies run on the default shape, then on
    :data:`~lmcache_async.bench.micro.options.WIDE_SHAPE` (``copy_wide``; None when it is
    the default shape). ``other_work``, in the results and in each part: how much of the
    CPUs other processes took meanwhile (see :mod:`~lmcache_async.bench.micro.machine`).

    Raises:
        InvalidInputError: the options are invalid.
        ConfigError: the engine refuses the configuration.
    """
    options.validate()
    layout = options.layout()
    gen = torch.Generator().manual_seed(options.seed)
    started = time.perf_counter()
    samples = [cpu_sample()]

    def done(part: dict[str, Any]) -> dict[str, Any]:
        samples.append(cpu_sample())
        part["other_work"] = other_work(samples[-2], samples[-1])
        return part

    # Hashing and lookups first: the long raw copies leave torch's OpenMP threads spinning
    # for a while, which would slow whatever is measured next on a 2-core machine.
    hashing = done(await anyio.to_thread.run_sync(hash_bench, options, config.chunk_size, gen))
    lookup = done(await lookup_bench(options, config, gen))
    small = done(await small_bench(options, config, gen))
    copies = done(await copy_bench(options, config, options.shape(), gen))
    wide = None
    if options.shape() != WIDE_SHAPE:
        wide = done(await copy_bench(options, config, WIDE_SHAPE, gen))
    parts: list[dict[str, Any]] = [copies, *([wide] if wide else []), small, lookup, hashing]
    return {
        "options": asdict(options),
        "engine_config": config.to_dict(),
        "method": (
            f"copies: median of {options.repeat} runs per shape after {WARMUP} warm-up; small "
            f"request: p50/p99 of {small['iterations']} after {ROUND} warm-up; lookups and "
            "hashing: median (p50) over many iterations after warm-up"
        ),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "other_work": other_work(samples[0], samples[-1]),
        "token_bytes": layout.token_bytes,
        "copy": copies,
        "copy_wide": wide,
        "small": small,
        "lookup": lookup,
        "hashing": hashing,
        "problems": [problem for part in parts for problem in part["problems"]],
        "seconds": time.perf_counter() - started,
    }


def run_micro(options: MicroOptions, config: EngineConfig) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_micro_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid.
        ConfigError: the engine refuses the configuration.
    """

    async def main() -> dict[str, Any]:
        return await run_micro_async(options, config)

    return anyio.run(main)
