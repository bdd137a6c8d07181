"""A whole micro-benchmark run: hashing, lookups, then the copies."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import anyio
import torch

from lmcache_async import EngineConfig
from lmcache_async.bench.micro.copies import copy_bench
from lmcache_async.bench.micro.hashing import hash_bench
from lmcache_async.bench.micro.lookup import lookup_bench
from lmcache_async.bench.micro.options import WARMUP, MicroOptions

__all__ = ["run_micro", "run_micro_async"]


async def run_micro_async(options: MicroOptions, config: EngineConfig) -> dict[str, Any]:
    """Run every micro-benchmark and return the figures as plain data.

    The engine configuration is used as given except for ``local_cpu`` (on) and
    ``max_local_cpu_size`` (sized to the benchmark, to bound memory).

    Raises:
        InvalidInputError: the options are invalid.
        ConfigError: the engine refuses the configuration.
    """
    options.validate()
    layout = options.layout()
    gen = torch.Generator().manual_seed(options.seed)
    started = time.perf_counter()
    # Hashing and lookups first: the raw copies leave torch's OpenMP threads spinning for a
    # while, which would slow whatever is measured next on a 2-core machine.
    hashing = await anyio.to_thread.run_sync(hash_bench, options, config.chunk_size, gen)
    lookup = await lookup_bench(options, config, gen)
    copies = await copy_bench(options, config, layout, gen)
    return {
        "options": asdict(options),
        "engine_config": config.to_dict(),
        "method": (
            f"median of {options.repeat} copy runs after {WARMUP} warm-up; lookups and "
            "hashing: median (p50) over many iterations after warm-up"
        ),
        "torch_threads": torch.get_num_threads(),
        "token_bytes": layout.token_bytes,
        "copy": copies,
        "lookup": lookup,
        "hashing": hashing,
        "problems": copies["problems"] + lookup["problems"] + hashing["problems"],
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
