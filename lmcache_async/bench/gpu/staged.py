"""Staged gather/scatter (:mod:`lmcache_async.transfer.staged`) against the per-chunk path.

One request of the scene's tokens cut into the engine's chunks, moved as one batch:

- **per chunk**: :meth:`TransferPlan.gather_chunks` / ``scatter_chunks`` (on CUDA one
  ``index_select`` / ``index_copy_`` per chunk, layer and K/V, a device buffer and a copy
  per chunk);
- **staged**: :class:`~lmcache_async.transfer.staged.StagedPlan` through one
  :class:`~lmcache_async.transfer.staging.StagingBuffer`, the payloads back to back in one
  pinned host tensor (as adjacent pool allocations are: one host copy per pass);
- **staged, apart**: the same with every payload its own pinned tensor (one copy each).

GB/s of the payload bytes, medians of ``repeat`` runs after a warm-up, each call timed
with the device synchronized before and after. The staged bytes are checked against the
per-chunk path's, outside the timings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from lmcache_async.bench import gbps
from lmcache_async.bench.baselines import synchronize, timed
from lmcache_async.bench.gpu.options import WARMUP
from lmcache_async.bench.gpu.scene import Scene
from lmcache_async.transfer.staged import Job, StagedPlan
from lmcache_async.transfer.staging import StagingBuffer

__all__ = ["staged_bench"]

_WAYS = ("per_chunk", "staged", "staged_apart")


def _payloads(scene: Scene, ranges: list[tuple[int, int]], *, apart: bool) -> list[torch.Tensor]:
    """Pinned (on CUDA) payloads for ``ranges``: each its own tensor, or carved back to back
    from one."""
    layout, cuda = scene.layout, scene.device.type == "cuda"
    shapes = [layout.payload_shape(end - start) for start, end in ranges]
    if apart:
        return [torch.empty(shape, dtype=layout.dtype, pin_memory=cuda) for shape in shapes]
    sizes = [math.prod(shape) for shape in shapes]
    arena = torch.empty(sum(sizes), dtype=layout.dtype, pin_memory=cuda)
    out: list[torch.Tensor] = []
    offset = 0
    for size, shape in zip(sizes, shapes, strict=True):
        out.append(arena[offset : offset + size].view(shape))
        offset += size
    return out


def _jobs(ranges: list[tuple[int, int]], payloads: list[torch.Tensor]) -> list[Job]:
    return [(start, end, p) for (start, end), p in zip(ranges, payloads, strict=True)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def _entry(nbytes: int, times: dict[str, list[float]], direction: str) -> dict[str, float]:
    rates = {way: gbps(nbytes, statistics.median(times[f"{direction}_{way}"])) for way in _WAYS}
    return {
        "per_chunk_gbps": rates["per_chunk"],
        "staged_gbps": rates["staged"],
        "staged_apart_gbps": rates["staged_apart"],
        "speedup": rates["staged"] / rates["per_chunk"],
        "apart_speedup": rates["staged_apart"] / rates["per_chunk"],
    }


async def staged_bench(scene: Scene, chunk_size: int, repeat: int) -> dict[str, Any]:
    """Staged and per-chunk gather (D2H) and scatter (H2D) GB/s of one request's chunks
    (async to run as a part of :func:`~lmcache_async.bench.gpu.run_gpu_bench_async`; the
    copies run on the caller's thread, as the engine-free baselines of the other parts do)."""
    device, layout = scene.device, scene.layout
    num_tokens = int(scene.tokens.shape[0])
    ranges = [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]
    src = layout.plan(scene.kv, scene.src_slots)
    dst = layout.plan(scene.kv, scene.dst_slots)
    staged_src, staged_dst = StagedPlan.from_plan(src), StagedPlan.from_plan(dst)
    together = _jobs(ranges, _payloads(scene, ranges, apart=False))
    apart = _jobs(ranges, _payloads(scene, ranges, apart=True))
    problems: list[str] = []
    with StagingBuffer(device) as staging:
        ways: dict[str, Callable[[], None]] = {
            "gather_per_chunk": lambda: src.gather_chunks(together),
            "gather_staged": lambda: staged_src.gather_chunks(together, staging),
            "gather_staged_apart": lambda: staged_src.gather_chunks(apart, staging),
            "scatter_per_chunk": lambda: dst.scatter_chunks(together),
            "scatter_staged": lambda: staged_dst.scatter_chunks(together, staging),
            "scatter_staged_apart": lambda: staged_dst.scatter_chunks(apart, staging),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        # The ways take turns within each run, so that clocks and other load weigh on all.
        for run in range(WARMUP + repeat):
            for name, fn in ways.items():
                seconds = timed(fn, device)
                if run >= WARMUP:
                    times[name].append(seconds)

        # Bit-exactness, outside the timings.
        src.gather_chunks(together)
        synchronize(device)
        expected = [p.clone() for _, _, p in together]
        verified = True
        for jobs in (together, apart):
            for _, _, p in jobs:
                p.zero_()
            staged_src.gather_chunks(jobs, staging)
            synchronize(device)
            if not _same([p for _, _, p in jobs], expected):
                verified = False
                problems.append("a staged gather differs from the per-chunk gather")
            scene.blank_destination()
            staged_dst.scatter_chunks(jobs, staging)
            synchronize(device)
            if not scene.destination_matches_source():
                verified = False
                problems.append("a staged scatter differs from the stored KV")
        copies = {
            "together": staged_src.host_copies(together, staging),
            "apart": staged_src.host_copies(apart, staging),
        }
        staging_bytes = staging.statistics().nbytes
    nbytes = scene.nbytes
    return {
        "tokens": num_tokens,
        "bytes": nbytes,
        "chunks": len(ranges),
        "chunk_size": chunk_size,
        "runs": repeat,
        "gather": _entry(nbytes, times, "gather"),
        "scatter": _entry(nbytes, times, "scatter"),
        # Host copies per batch: one per pass through the buffer when the payloads are back
        # to back, one per payload when they are apart.
        "host_copies": copies,
        "staging_bytes": staging_bytes,
        "verified_bit_exact": verified,
        "problems": problems,
    }
