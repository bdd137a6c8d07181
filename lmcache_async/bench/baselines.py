"""The plain-torch baselines the micro and GPU benchmarks measure the engine's copies against.

A baseline moves the same bytes the engine moves, the plain way: per layer and K/V one
``index_select`` of the slots' rows into a preallocated ``[2, L, T, H*D]`` buffer (a
store's gather) or one ``index_copy_`` back (a retrieve's scatter), on the rows of an NHD
flash-attention cache viewed as ``[num_blocks * block_size, H*D]``. Above both stands the
memory's limit: one contiguous ``copy_`` of as many bytes (:func:`plain_copy`).
:func:`copy_entry` turns the engine's and the baseline's times into the figures both
benchmarks report; :func:`plain_entry` adds the plain copy beside them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_async import KVLayout
from lmcache_async.bench import gbps
from lmcache_async.config import GB

__all__ = [
    "cache_gb",
    "copy_entry",
    "gather_rows",
    "plain_copy",
    "plain_entry",
    "row_views",
    "scatter_rows",
    "slots_over",
    "synchronize",
    "timed",
]


def slots_over(blocks: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Slots of ``num_tokens`` tokens laid over ``blocks`` in order; int64 ``[num_tokens]``."""
    pos = torch.arange(num_tokens, dtype=torch.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


def row_views(layout: KVLayout, kv_caches: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per layer, K and V of an NHD flash-attn cache as ``[num_blocks * block_size, H*D]``."""
    return [[layer[k].view(-1, layout.width) for k in range(2)] for layer in kv_caches]


def gather_rows(views: list[list[torch.Tensor]], rows: torch.Tensor, out: torch.Tensor) -> None:
    """The plain baseline of a store: one ``index_select`` per layer and K/V into ``out``.

    ``out`` is ``[2, L, T, H*D]``, contiguous.
    """
    for layer, pair in enumerate(views):
        for k, src in enumerate(pair):
            torch.index_select(src, 0, rows, out=out[k, layer])


def scatter_rows(views: list[list[torch.Tensor]], rows: torch.Tensor, src: torch.Tensor) -> None:
    """The plain baseline of a retrieve: one ``index_copy_`` per layer and K/V from ``src``
    (``[2, L, T, H*D]``)."""
    for layer, pair in enumerate(views):
        for k, dst in enumerate(pair):
            dst.index_copy_(0, rows, src[k, layer])


def plain_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The memory's limit for a copy of ``src``'s bytes: one contiguous ``dst.copy_(src)``
    (both contiguous, of one shape and dtype), on torch's threads."""
    dst.copy_(src)


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on ``device`` when it is a CUDA device (else nothing)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds of ``fn()``, with ``device`` synchronized before and after when it is a CUDA
    device (so that copies queued by ``fn`` count)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def cache_gb(nbytes: int) -> float:
    """Arena size in config GB for ``nbytes`` of payload, with room for page rounding."""
    return max(2 * nbytes + 64 * 1024**2, 64 * 1024**2) / GB


def copy_entry(
    nbytes: int, engine_times: list[float], raw_times: list[float], *, target_ratio: float
) -> dict[str, Any]:
    """The engine's GB/s next to the baseline's for ``nbytes`` moved: medians, bests, their
    ratio and whether it reaches ``target_ratio``."""
    engine = gbps(nbytes, statistics.median(engine_times))
    raw = gbps(nbytes, statistics.median(raw_times))
    ratio = engine / raw
    return {
        "engine_gbps": engine,
        "raw_gbps": raw,
        "ratio": ratio,
        "engine_best_gbps": gbps(nbytes, min(engine_times)),
        "raw_best_gbps": gbps(nbytes, min(raw_times)),
        "target_ratio": target_ratio,
        "ok": ratio >= target_ratio,
    }


def plain_entry(
    nbytes: int, engine_times: list[float], plain_times: list[float], *, target_ratio: float
) -> dict[str, Any]:
    """The plain contiguous copy's GB/s for ``nbytes`` beside the engine's (medians and
    best), their ratio and whether it reaches ``target_ratio``: the ``plain_*`` keys that
    complete a :func:`copy_entry`."""
    engine = gbps(nbytes, statistics.median(engine_times))
    plain = gbps(nbytes, statistics.median(plain_times))
    ratio = engine / plain
    return {
        "plain_gbps": plain,
        "plain_best_gbps": gbps(nbytes, min(plain_times)),
        "plain_ratio": ratio,
        "plain_target_ratio": target_ratio,
        "plain_ok": ratio >= target_ratio,
    }
