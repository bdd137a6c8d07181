"""What the micro-benchmarks measure: their sizes, model shape and targets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Final

from lmcache_async import InvalidInputError, KVLayout
from lmcache_async.bench import parse_dtype

__all__ = ["TARGETS", "VOCAB", "WARMUP", "MicroOptions"]

TARGETS: Final[Mapping[str, float]] = {
    "copy_ratio": 0.7,
    "lookup_p50_ms": 0.5,
    "hash_list_mtps": 30.0,
    "hash_tensor_mtps": 100.0,
    "overhead_us": 500.0,
}
"""Targets on a 2-core CPU machine: store/retrieve at least 0.7x the raw copy, a 32k-token
lookup p50 at most 0.5 ms, hashing at least 30 M tokens/s from a list and 100 M from a
tensor, per-request overhead of a few hundred microseconds."""

WARMUP: Final = 1
VOCAB: Final = 32000


@dataclass(frozen=True, slots=True)
class MicroOptions:
    """Sizes and model shape of the micro-benchmarks."""

    seed: int = 0
    tokens: int = 8192
    """Tokens per store/retrieve in the copy benchmark."""
    lookup_tokens: int = 32768
    """Prompt length of the lookup and hashing benchmarks."""
    repeat: int = 5
    """Measured runs of the copy benchmark (after one warm-up run)."""
    overhead_tokens: int = 1024
    overhead_iterations: int = 20
    lookup_iterations: int = 200
    hash_iterations: int = 30
    num_layers: int = 16
    num_kv_heads: int = 8
    head_size: int = 64
    dtype: str = "bfloat16"
    block_size: int = 16

    def validate(self) -> None:
        """Check the options.

        Raises:
            InvalidInputError: a count or size is not positive, the dtype is unknown, or
                ``overhead_tokens`` exceeds ``tokens``.
        """
        for name, value in asdict(self).items():
            if name in ("seed", "dtype"):
                continue
            if not value > 0:
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        if self.overhead_tokens > self.tokens:
            raise InvalidInputError(
                f"overhead_tokens must be <= tokens, got {self.overhead_tokens} > {self.tokens}"
            )
        parse_dtype(self.dtype)

    def layout(self) -> KVLayout:
        """The vLLM flash-attention (NHD) layout of the copy benchmark."""
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )
