"""A whole GPU benchmark run: the copies, then the layerwise overlap, on one engine."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import anyio
import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.bench.baselines import cache_gb
from lmcache_async.bench.gpu.copies import copy_bench
from lmcache_async.bench.gpu.layerwise import layerwise_bench
from lmcache_async.bench.gpu.options import CPU_NOTE, WARMUP, GpuOptions
from lmcache_async.bench.gpu.scene import make_scene

__all__ = ["run_gpu_bench", "run_gpu_bench_async"]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


async def run_gpu_bench_async(options: GpuOptions, config: EngineConfig) -> dict[str, Any]:
    """Run the copy and layerwise benchmarks and return the figures as plain data.

    The engine configuration is used as given except for ``local_cpu`` (on) and
    ``max_local_cpu_size`` (sized to the benchmark).

    Raises:
        InvalidInputError: the options are invalid, or CUDA was asked for and is missing.
        ConfigError: the engine refuses the configuration.
    """
    options.validate()
    device = options.torch_device()
    started = time.perf_counter()
    scene = make_scene(options, device)
    cfg = config.replace(local_cpu=True, max_local_cpu_size=cache_gb(scene.nbytes))
    async with CacheEngine.open(cfg, scene.layout, model_name="lmcache-async-gpu") as engine:
        copies = await copy_bench(engine, scene, options.repeat)
        layerwise = await layerwise_bench(engine, scene, options)
    cuda = device.type == "cuda"
    return {
        "options": asdict(options),
        "engine_config": config.to_dict(),
        "device": str(device),
        "device_name": _device_name(device),
        "cuda": cuda,
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "note": None if cuda else CPU_NOTE,
        "method": (
            f"median of {options.repeat} runs after {WARMUP} warm-up; wall clock around each "
            "call, device synchronized before and after"
        ),
        "token_bytes": scene.layout.token_bytes,
        "copy": copies,
        "layerwise": layerwise,
        "problems": copies["problems"] + layerwise["problems"],
        "seconds": time.perf_counter() - started,
    }


def run_gpu_bench(options: GpuOptions, config: EngineConfig) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_gpu_bench_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid, or CUDA was asked for and is missing.
        ConfigError: the engine refuses the configuration.
    """

    async def main() -> dict[str, Any]:
        return await run_gpu_bench_async(options, config)

    return anyio.run(main)
