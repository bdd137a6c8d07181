"""What the disk and Redis benchmarks share: the chunk records they move (in the clear or
encrypted), argument checks, random payloads and the interleaved timing of a tier, its
encrypted twin and their raw baseline."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

import torch

from lmcache_async import InvalidInputError
from lmcache_async.backends.cipher import KEY_BYTES, RecordCipher
from lmcache_async.backends.codec import Codec
from lmcache_async.backends.record import RecordSpec

__all__ = [
    "BENCH_DTYPE",
    "BENCH_TOKENS",
    "CHUNK_GRANULE",
    "ENCRYPTION_TARGETS",
    "bench_cipher",
    "bench_spec",
    "check_count",
    "fill_random",
    "interleaved",
]

BENCH_TOKENS: Final = 256
BENCH_DTYPE: Final = torch.bfloat16
# Bytes per token of a chunk's [2, 1, tokens, width] bf16 payload must be whole elements.
CHUNK_GRANULE: Final = 2 * BENCH_TOKENS * 2

ENCRYPTION_TARGETS: Final[Mapping[str, float]] = {
    "encrypted_put_ratio": 0.8,
    "encrypted_get_ratio": 0.8,
}
"""An encrypted tier should reach at least 0.8x the same tier in the clear."""


def _bench_shape(width: int, tokens: int) -> tuple[int, ...]:
    return (2, 1, tokens, width)


def bench_spec(tier: str, chunk_bytes: int, cipher: RecordCipher | None = None) -> RecordSpec:
    """The record of a ``chunk_bytes`` chunk (``[2, 1, tokens, width]`` bf16, uncompressed,
    sealed with ``cipher`` if one is given) in ``tier``'s benchmark; ``chunk_bytes`` is a
    multiple of :data:`CHUNK_GRANULE`."""
    width = chunk_bytes // CHUNK_GRANULE
    return RecordSpec(
        fingerprint=f"bench-{tier};width={width}",
        fmt="KV_2LTD",
        dtype=BENCH_DTYPE,
        max_tokens=BENCH_TOKENS,
        shape_of=functools.partial(_bench_shape, width),
        codec=Codec.NONE,
        cipher=cipher,
    )


def bench_cipher() -> RecordCipher:
    """A cipher under a random master key, for one benchmark run."""
    return RecordCipher(os.urandom(KEY_BYTES))


def check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    return value


async def interleaved(
    sides: Sequence[Callable[[int, int], Awaitable[None]]],
    spans: list[tuple[int, int]],
    run: int,
) -> list[float]:
    """Seconds each of ``sides`` takes over all spans: a batch through each side in turn,
    the same batch, and who goes first rotates from batch to batch (with two sides: it
    alternates), so all see the same background load."""
    times = [0.0] * len(sides)
    for n, (lo, hi) in enumerate(spans):
        first = (n + run) % len(sides)
        for turn in range(len(sides)):
            side = (first + turn) % len(sides)
            start = time.perf_counter()
            await sides[side](lo, hi)
            times[side] += time.perf_counter() - start
    return times


def fill_random(tensors: list[torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(0)
    for tensor in tensors:
        flat = tensor.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
