"""What the scale benchmark runs: the sizes, the tiers, the requests measured at each size,
and the tiny KV layout whose chunks are 4 KiB."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.layouts import KVLayout

__all__ = [
    "CHUNK_TOKENS",
    "DEFAULT_SIZES",
    "INDEX_OVER_WALK_TARGET",
    "REQUEST_TOKENS",
    "TIERS",
    "ScaleOptions",
    "parse_sizes",
    "scale_layout",
]

TIERS: Final = ("cpu", "disk", "redis")
"""The tiers measured, in the order they run and are reported."""

DEFAULT_SIZES: Final = (10_000, 50_000, 200_000)
"""Chunks each tier holds, one size after the other."""

CHUNK_TOKENS: Final = 256
"""Tokens per chunk (the engine's ``chunk_size`` in this benchmark)."""

REQUEST_TOKENS: Final = 1024
"""Tokens of each measured request: four chunks."""

INDEX_OVER_WALK_TARGET: Final = 2.0
"""The disk tier's index, with a manifest, should be complete within twice the time of a
names-only walk of its directory at the largest size."""

FILL_PROMPT_CHUNKS: Final = 64
"""Chunks of each prompt the CPU tier is filled with (one store each)."""


def scale_layout() -> KVLayout:
    """One layer, one KV head of 4, float16: 16 bytes of KV per token, so a 256-token chunk
    holds 2 (K, V) x 1 x 256 x 1 x 4 x 2 bytes = 4 KiB, and what is measured is the
    tiers' and the engine's cost per request, not copies."""
    return KVLayout.vllm_flash_attn(
        num_layers=1, num_kv_heads=1, head_size=4, block_size=16, dtype=torch.float16
    )


@dataclass(frozen=True, slots=True)
class ScaleOptions:
    """The ``lmcache-async bench --scale`` settings."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Chunks each tier holds when it is measured, smallest first (sorted at the start)."""
    tiers: tuple[str, ...] = TIERS
    """The tiers to measure, some of :data:`TIERS`."""
    requests: int = 100
    """Requests measured at each size (store, lookup and retrieve each); their p50."""
    warmup: int = 10
    """Requests before those measured, at each size (not counted)."""
    repeats: int = 3
    """Names-only walks of a disk directory, and opens of its tier with the manifest,
    timed at each size; the best of each is reported (the open without a manifest, which
    reads every header, runs once)."""
    seed: int = 0
    work_dir: str | None = None
    """Where the disk directories (and the Redis server's files) go: kept, and a directory
    filled by an earlier run with the same size, seed, requests and warmup (the same
    probes) is used again. None: a temporary directory removed after the run."""

    @property
    def probes(self) -> int:
        """Prompts measured at each size (each looked up and retrieved once)."""
        return self.warmup + self.requests

    def validate(self) -> None:
        """Check every setting.

        Raises:
            InvalidInputError: no size, a size that is not an int, one that does not hold
                the measured prompts (four chunks each, twice over), a repeated size, an
                unknown or repeated tier, or a count that is not a positive int.
        """
        for name in ("requests", "repeats"):
            value = getattr(self, name)
            if not is_strict_int(value) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        if not is_strict_int(self.warmup) or self.warmup < 0:
            raise InvalidInputError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if not is_strict_int(self.seed):
            raise InvalidInputError(f"seed must be an int, got {self.seed!r}")
        if not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise InvalidInputError(f"tiers must be some of {', '.join(TIERS)}, each once")
        unknown = [tier for tier in self.tiers if tier not in TIERS]
        if unknown:
            raise InvalidInputError(
                f"unknown tier {unknown[0]!r}; tiers must be some of {', '.join(TIERS)}"
            )
        if not self.sizes:
            raise InvalidInputError("sizes must name at least one size")
        if len(set(self.sizes)) != len(self.sizes):
            raise InvalidInputError(f"sizes must differ, got {list(self.sizes)}")
        least = 2 * self.probes * (REQUEST_TOKENS // CHUNK_TOKENS)
        for size in self.sizes:
            if not is_strict_int(size) or size < least:
                raise InvalidInputError(
                    f"each size must be an int >= {least} (the {self.probes} prompts "
                    f"measured, {REQUEST_TOKENS // CHUNK_TOKENS} chunks each, twice), "
                    f"got {size!r}"
                )

    def ordered_sizes(self) -> tuple[int, ...]:
        """The sizes, smallest first."""
        return tuple(sorted(self.sizes))

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (for the results)."""
        return asdict(self)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"10000,50000,200k"`` as ``(10000, 50000, 200000)`` (``k`` is a thousand).

    Raises:
        InvalidInputError: an item is not a whole number.
    """
    sizes: list[int] = []
    for item in text.split(","):
        word = item.strip().lower().replace("_", "")
        scale = 1000 if word.endswith("k") else 1
        digits = word.removesuffix("k")
        if not digits.isdigit():
            raise InvalidInputError(f"sizes must be whole numbers (e.g. 10k,50k), got {item!r}")
        sizes.append(int(digits) * scale)
    return tuple(sizes)
