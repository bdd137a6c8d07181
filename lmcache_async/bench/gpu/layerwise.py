"""Layerwise retrieve overlapped with a simulated per-layer compute, against the two back
to back: how much of the transfer the compute hides."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any, Final

import torch

from lmcache_async import CacheEngine
from lmcache_async.bench import gbps
from lmcache_async.bench.baselines import synchronize, timed
from lmcache_async.bench.gpu.options import TARGETS, WARMUP, GpuOptions
from lmcache_async.bench.gpu.scene import Scene, atimed

__all__ = ["layerwise_bench"]

# Square matmuls of the simulated compute: small enough that a layer's worth is a whole
# number of them to within a few percent, large enough to keep the device busy.
_MATMUL_DIM: Final = {"cuda": 2048, "cpu": 64}
_CALIBRATION_MATMULS: Final = 50


class _Compute:
    """A simulated layer of model compute: ``reps`` square matmuls on the current stream."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.device = device
        # The CPU has no fast bf16 matmul; the stand-in only has to take time.
        self.dtype = dtype if device.type == "cuda" else torch.float32
        self.dim = _MATMUL_DIM[device.type]
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(self.dim, self.dim, generator=gen) / math.sqrt(self.dim)
        self._a = a.to(device=device, dtype=self.dtype)
        self._b = self._a.t().contiguous()
        self._out = torch.empty_like(self._a)
        self.reps = 1
        self.matmul_seconds = math.nan

    def layer(self) -> None:
        for _ in range(self.reps):
            torch.mm(self._a, self._b, out=self._out)

    def calibrate(self, layer_seconds: float) -> None:
        """Choose ``reps`` so that one layer's compute takes about ``layer_seconds``."""
        for _ in range(3):
            torch.mm(self._a, self._b, out=self._out)

        def burst() -> None:
            for _ in range(_CALIBRATION_MATMULS):
                torch.mm(self._a, self._b, out=self._out)

        self.matmul_seconds = timed(burst, self.device) / _CALIBRATION_MATMULS
        self.reps = max(1, round(layer_seconds / self.matmul_seconds))


async def _retrieve_layers(
    engine: CacheEngine, scene: Scene, compute: Callable[[], None] | None
) -> torch.Tensor | None:
    """Drive one layerwise retrieve as a serving engine does; the mask it yields last.

    With ``compute``, layer *i*'s compute is queued right after step *i + 1* says layer *i*
    is loaded, while layer *i + 1*'s copy runs.
    """
    it = engine.retrieve_layer(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.dst_slots)
    result: torch.Tensor | None = None
    try:
        await anext(it)
        for _ in range(scene.layout.num_layers):
            result = await anext(it)
            if compute is not None:
                compute()
    finally:
        await it.aclose()
    return result


async def layerwise_bench(engine: CacheEngine, scene: Scene, options: GpuOptions) -> dict[str, Any]:
    """Layerwise retrieve interleaved with a simulated per-layer compute vs back to back."""
    device, layout = scene.device, scene.layout
    num_layers = layout.num_layers
    num_tokens = int(scene.tokens.shape[0])
    problems: list[str] = []
    await engine.clear()
    stored: int | None = None
    it = engine.store_layer(scene.tokens, kv_caches=scene.kv, slot_mapping=scene.src_slots)
    try:
        for _ in range(num_layers + 1):
            step = await anext(it)
            if step is not None:
                stored = step
    finally:
        await it.aclose()
    if stored != num_tokens:
        problems.append(f"store_layer stored {stored} of {num_tokens} tokens")

    masks: list[torch.Tensor | None] = []

    async def transfer() -> None:
        masks.append(await _retrieve_layers(engine, scene, None))

    compute = _Compute(device, layout.dtype, options.seed)

    def compute_all() -> None:
        for _ in range(num_layers):
            compute.layer()

    async def serial() -> None:
        masks.append(await _retrieve_layers(engine, scene, None))
        compute_all()

    async def overlap() -> None:
        masks.append(await _retrieve_layers(engine, scene, compute.layer))

    # Size the compute to the transfer it should hide.
    calibration = [await atimed(device, transfer) for _ in range(WARMUP + 2)][WARMUP:]
    compute.calibrate(options.compute_ratio * statistics.median(calibration) / num_layers)
    compute_all()  # warm-up of the compute at its final size

    times: dict[str, list[float]] = {"transfer": [], "compute": [], "serial": [], "overlap": []}
    for run in range(WARMUP + options.repeat):
        sample = {
            "transfer": await atimed(device, transfer),
            "compute": timed(compute_all, device),
            "serial": await atimed(device, serial),
            "overlap": await atimed(device, overlap),
        }
        if run >= WARMUP:
            for name, seconds in sample.items():
                times[name].append(seconds)
    if not all(mask is not None and bool(mask.all()) for mask in masks):
        problems.append("retrieve_layer did not load every token")

    scene.blank_destination()
    await _retrieve_layers(engine, scene, None)
    synchronize(device)
    verified = scene.destination_matches_source()
    if not verified:
        problems.append("layerwise retrieved KV differs from the stored KV")

    med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    hidden = (med["serial"] - med["overlap"]) / med["transfer"]
    return {
        "tokens": num_tokens,
        "layers": num_layers,
        "bytes": scene.nbytes,
        "runs": options.repeat,
        "matmul_dim": compute.dim,
        "matmul_dtype": str(compute.dtype).removeprefix("torch."),
        "matmul_ms": compute.matmul_seconds * 1e3,
        "matmuls_per_layer": compute.reps,
        "compute_ratio": options.compute_ratio,
        "transfer_ms": med["transfer"],
        "compute_ms": med["compute"],
        "serial_ms": med["serial"],
        "overlap_ms": med["overlap"],
        "transfer_gbps": gbps(scene.nbytes, med["transfer"] / 1e3),
        "hidden_fraction": hidden,
        "hideable_fraction": min(1.0, med["compute"] / med["transfer"]),
        "target_hidden": TARGETS["hidden_fraction"],
        "ok": hidden >= TARGETS["hidden_fraction"],
        "verified_bit_exact": verified,
        "problems": problems,
    }
