"""What the disk and Redis benchmarks share: the chunk records they move, argument checks,
random payloads and the interleaved timing of a tier and its raw baseline."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Final

import torch

from lmcache_async import InvalidInputError
from lmcache_async.backends.codec import Codec
from lmcache_async.backends.record import RecordSpec

__all__ = [
    "BENCH_DTYPE",
    "BENCH_TOKENS",
    "CHUNK_GRANULE",
    "bench_spec",
    "check_count",
    "fill_random",
    "interleaved",
]

BENCH_TOKENS: Final = 256
BENCH_DTYPE: Final = torch.bfloat16
# Bytes per token of a chunk's [2, 1, tokens, width] bf16 payload must be whole elements.
CHUNK_GRANULE: Final = 2 * BENCH_TOKENS * 2


def _bench_shape(width: int, tokens: int) -> tuple[int, ...]:
    return (2, 1, tokens, width)


def bench_spec(tier: str, chunk_bytes: int) -> RecordSpec:
    """The record of a ``chunk_bytes`` chunk (``[2, 1, tokens, width]`` bf16, uncompressed)
    in ``tier``'s benchmark; ``chunk_bytes`` is a multiple of :data:`CHUNK_GRANULE`."""
    width = chunk_bytes // CHUNK_GRANULE
    return RecordSpec(
        fingerprint=f"bench-{tier};width={width}",
        fmt="KV_2LTD",
        dtype=BENCH_DTYPE,
        max_tokens=BENCH_TOKENS,
        shape_of=functools.partial(_bench_shape, width),
        codec=Codec.NONE,
    )


def check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    return value


async def interleaved(
    tier: Callable[[int, int], Awaitable[None]],
    raw: Callable[[int, int], Awaitable[None]],
    spans: list[tuple[int, int]],
    run: int,
) -> tuple[float, float]:
    """Seconds ``tier`` and ``raw`` take over all spans, a batch of one then the same batch
    of the other (who goes first alternates), so both see the same background load."""
    times = [0.0, 0.0]
    sides = (tier, raw)
    for n, (lo, hi) in enumerate(spans):
        for side in (0, 1) if (n + run) % 2 == 0 else (1, 0):
            start = time.perf_counter()
            await sides[side](lo, hi)
            times[side] += time.perf_counter() - start
    return times[0], times[1]


def fill_random(tensors: list[torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(0)
    for tensor in tensors:
        flat = tensor.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
