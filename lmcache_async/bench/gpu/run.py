"""A whole GPU benchmark run: the copies, the layerwise overlap (on one engine), then the
staged gather/scatter against the per-chunk path.

Each part is kept apart from the other: a part that raises is recorded as
``{"error": ...}`` with a problem and the next part still runs, and the figures of each
part are logged (``gpu_bench_part_done``) and handed to an optional ``checkpoint`` as soon
as it ends, so that a failure or a kill later in the run does not lose them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from typing import Any, Final

import anyio
import torch

from lmcache_async import CacheEngine, EngineConfig
from lmcache_async.bench.baselines import cache_gb
from lmcache_async.bench.gpu.copies import copy_bench
from lmcache_async.bench.gpu.layerwise import layerwise_bench
from lmcache_async.bench.gpu.options import CPU_NOTE, WARMUP, GpuOptions
from lmcache_async.bench.gpu.scene import Scene, make_scene
from lmcache_async.bench.gpu.staged import staged_bench
from lmcache_async.logging import get_logger

__all__ = ["PARTS", "Checkpoint", "run_gpu_bench", "run_gpu_bench_async"]

log = get_logger(__name__)

PARTS: Final = ("copy", "layerwise", "staged")
"""The parts of a run, in the order they run; each is a key of the results."""

Checkpoint = Callable[[Mapping[str, Any]], None]
"""Called with the results so far after each part (parts not run yet are ``None``)."""


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


def _results(
    options: GpuOptions,
    config: EngineConfig,
    scene: Scene,
    parts: Mapping[str, dict[str, Any] | None],
    started: float,
) -> dict[str, Any]:
    """The results of a run with the parts done so far (``None`` for those not run yet)."""
    cuda = scene.device.type == "cuda"
    problems: list[str] = []
    for part in parts.values():
        if part is not None:
            problems += part["problems"]
    return {
        "options": asdict(options),
        "engine_config": config.to_dict(),
        "device": str(scene.device),
        "device_name": _device_name(scene.device),
        "cuda": cuda,
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "note": None if cuda else CPU_NOTE,
        "method": (
            f"median of {options.repeat} runs after {WARMUP} warm-up; wall clock around each "
            "call, device synchronized before and after"
        ),
        "token_bytes": scene.layout.token_bytes,
        **parts,
        "problems": problems,
        "seconds": time.perf_counter() - started,
    }


async def _part(name: str, bench: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """One part's figures; a part that raises becomes ``{"error": ..., "problems": [...]}``."""
    try:
        figures = await bench()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("gpu_bench_part_failed", part=name, error=error)
        return {"error": error, "problems": [f"{name} failed: {error}"]}
    log.info("gpu_bench_part_done", part=name, figures=figures)
    return figures


async def run_gpu_bench_async(
    options: GpuOptions, config: EngineConfig, *, checkpoint: Checkpoint | None = None
) -> dict[str, Any]:
    """Run the copy, layerwise and staged benchmarks and return the figures as plain data.

    The engine configuration is used as given except for ``local_cpu`` (on) and
    ``max_local_cpu_size`` (sized to the benchmark). A part that raises is recorded under
    its key as ``{"error": "Type: message", "problems": [...]}`` and the run goes on;
    ``checkpoint``, when given, gets the results so far after each part (to save them).

    Raises:
        InvalidInputError: the options are invalid, or CUDA was asked for and is missing.
        ConfigError: the engine refuses the configuration.
    """
    options.validate()
    device = options.torch_device()
    started = time.perf_counter()
    scene = make_scene(options, device)
    cfg = config.replace(local_cpu=True, max_local_cpu_size=cache_gb(scene.nbytes))
    parts: dict[str, dict[str, Any] | None] = dict.fromkeys(PARTS)
    async with CacheEngine.open(cfg, scene.layout, model_name="lmcache-async-gpu") as engine:
        benches: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "copy": lambda: copy_bench(engine, scene, options.repeat),
            "layerwise": lambda: layerwise_bench(engine, scene, options),
            "staged": lambda: staged_bench(scene, cfg.chunk_size, options.repeat),
        }
        for name in PARTS:
            parts[name] = await _part(name, benches[name])
            if checkpoint is not None:
                checkpoint(_results(options, config, scene, parts, started))
    return _results(options, config, scene, parts, started)


def run_gpu_bench(
    options: GpuOptions, config: EngineConfig, *, checkpoint: Checkpoint | None = None
) -> dict[str, Any]:
    """Blocking wrapper of :func:`run_gpu_bench_async` (runs its own event loop).

    Raises:
        InvalidInputError: the options are invalid, or CUDA was asked for and is missing.
        ConfigError: the engine refuses the configuration.
    """

    async def main() -> dict[str, Any]:
        return await run_gpu_bench_async(options, config, checkpoint=checkpoint)

    return anyio.run(main)
