"""What the micro-benchmarks measure: their sizes, model shapes and targets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Final

from lmcache_async import InvalidInputError, KVLayout
from lmcache_async.bench import parse_dtype

__all__ = [
    "SMALL_CHUNK",
    "SMALL_SHAPE",
    "TARGETS",
    "VOCAB",
    "WARMUP",
    "WIDE_SHAPE",
    "MicroOptions",
    "Shape",
]

TARGETS: Final[Mapping[str, float]] = {
    "copy_plain_ratio": 0.8,
    "copy_raw_ratio": 1.0,
    "lookup_p50_ms": 0.5,
    "hash_list_mtps": 30.0,
    "hash_tensor_mtps": 100.0,
    "small_p50_ms": 0.3,
}
"""Targets on a 2-core CPU machine: store/retrieve at least 0.8x a plain contiguous
``copy_`` of the same bytes (the memory's limit) and never below the raw ``index_select`` /
``index_copy_`` of the same rows; a 32k-token lookup p50 at most 0.5 ms; hashing at least
30 M tokens/s from a list and 100 M from a tensor; a 1k-token store and retrieve of the
small shape at most 0.3 ms p50 each."""

WARMUP: Final = 1
VOCAB: Final = 32000


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's KV shape: layers, KV heads, head size and dtype name."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @property
    def label(self) -> str:
        """``layers x heads x head_size dtype``, as the report prints it."""
        return f"{self.num_layers}x{self.num_kv_heads}x{self.head_size} {self.dtype}"

    def layout(self, block_size: int) -> KVLayout:
        """The vLLM flash-attention (NHD) layout of this shape.

        Raises:
            InvalidInputError: the dtype name is unknown.
        """
        return KVLayout.vllm_flash_attn(
            num_layers=self.num_layers,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=parse_dtype(self.dtype),
        )


WIDE_SHAPE: Final = Shape(num_layers=8, num_kv_heads=8, head_size=128, dtype="bfloat16")
"""The second shape of the copy benchmark: Llama-3-8B's KV heads (8 of its 32 layers), rows
of 2 KiB where the default shape's are 1 KiB; the same 32 KiB per token."""

SMALL_SHAPE: Final = Shape(num_layers=2, num_kv_heads=1, head_size=32, dtype="bfloat16")
"""The small-request benchmark's shape: copies of a few KiB, so its time is the engine's
per-request cost."""

SMALL_CHUNK: Final = 256
"""Tokens per chunk of the small-request benchmark, whatever the configuration says."""


@dataclass(frozen=True, slots=True)
class MicroOptions:
    """Sizes and model shape of the micro-benchmarks."""

    seed: int = 0
    tokens: int = 8192
    """Tokens per store/retrieve in the copy benchmark."""
    lookup_tokens: int = 32768
    """Prompt length of the lookup and hashing benchmarks."""
    repeat: int = 5
    """Measured runs of the copy benchmark (after one warm-up run), per shape."""
    overhead_tokens: int = 1024
    """Tokens of a request in the small-request benchmark."""
    overhead_iterations: int = 400
    """Measured requests of the small-request benchmark (after a round of warm-up)."""
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
            InvalidInputError: a count or size is not positive, or the dtype is unknown.
        """
        for name, value in asdict(self).items():
            if name in ("seed", "dtype"):
                continue
            if not value > 0:
                raise InvalidInputError(f"{name} must be > 0, got {value!r}")
        parse_dtype(self.dtype)

    def shape(self) -> Shape:
        """The default shape: the copy benchmark's first, the lookups' dtype."""
        return Shape(self.num_layers, self.num_kv_heads, self.head_size, self.dtype)

    def layout(self) -> KVLayout:
        """The vLLM flash-attention (NHD) layout of the default shape."""
        return self.shape().layout(self.block_size)
