"""The vocabulary of KV layouts: element types, payload formats, engine-side kinds, vLLM's
CPU packings, and the fields of a layout that the helpers of this package read.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Protocol

import torch

from lmcache_async.errors import InvalidInputError

__all__ = [
    "SUPPORTED_DTYPES",
    "CpuKVPacking",
    "KVFormat",
    "LayoutKind",
    "PagedLayout",
    "as_cpu_packing",
    "dtype_name",
    "is_integer_dtype",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
"""Element types a KV cache may have."""


class KVFormat(enum.StrEnum):
    """Shape of a chunk payload, the bytes that leave and re-enter the engine."""

    KV_2LTD = "KV_2LTD"
    """``[2, num_layers, tokens, num_kv_heads * head_size]``; index 0 is K, 1 is V."""
    KV_T2D = "KV_T2D"
    """Reserved for layerwise payloads, per layer ``[tokens, 2, heads * head_size]``."""
    KV_MLA = "KV_MLA"
    """``[1, num_layers, tokens, latent_dim]``."""


class LayoutKind(enum.StrEnum):
    """Which engine-side memory layout a :class:`~lmcache_async.layouts.KVLayout` describes."""

    VLLM_FLASH_ATTN = "vllm_flash_attn"
    """Per layer ``[2, num_blocks, block_size, H, D]``; NHD is contiguous, HND has the same
    logical shape with memory ordered ``[2, num_blocks, H, block_size, D]``."""
    FLASHINFER = "flashinfer"
    """Per layer ``[num_blocks, 2, block_size, H, D]``, contiguous."""
    MLA = "mla"
    """Per layer ``[num_blocks, block_size, latent_dim]``, contiguous."""
    VLLM_CPU = "vllm_cpu"
    """vLLM's CPU attention backend: per layer ``[num_blocks, H, block_size, 2 * D]``,
    contiguous. Each block and head holds ``block_size * D`` key elements, then as many
    value elements, each region packed as its :class:`CpuKVPacking` says."""


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers (bool does not count)."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name without the ``torch.`` prefix, as messages and dicts spell it."""
    return str(dtype).removeprefix("torch.")


_VLLM_TRANSPOSED_KEY_ISAS = frozenset({"vec", "vec16", "vxe", "vsx", "rvv"})
"""vLLM CPU attention kernels that write keys transposed and values as rows, every dtype."""


class CpuKVPacking(enum.StrEnum):
    """How vLLM's CPU attention packs one block and head of the KV cache.

    vLLM writes the cache with ``cpu_attn_reshape_and_cache`` in the order its attention
    kernel (the "ISA" it picks for the dtype, block size and CPU) reads fastest. Per
    block ``b`` and head ``h`` the layer holds a key region of ``block_size * D`` elements
    followed by a value region of the same size; the packings differ in where token ``t``,
    dimension ``d`` sits inside each region.
    """

    KEYS_TRANSPOSED = "keys_transposed"
    """Keys ``[D, block_size]`` (``d * block_size + t``), values ``[block_size, D]``
    (``t * D + d``). vLLM's ``vec``, ``vec16``, ``vxe``, ``vsx`` and ``rvv`` kernels, and
    ``neon`` for fp32 and fp16: every dtype on x86 CPUs without AMX."""
    TOKEN_ROWS = "token_rows"
    """Each token one row of ``2 * D``, its keys then its values: per block and head
    ``[block_size, 2 * D]`` (``t * 2D + d``, values at ``+ D``). Not a CPU kernel's packing:
    vLLM 0.32's GPU flash-attention backend keeps its cache ``[num_blocks, H, block_size,
    2 * D]`` this way (it reads ``kv_cache.transpose(1, 2).split(D, -1)``)."""
    AMX = "amx"
    """bf16 on CPUs with AMX: keys ``[block_size / 16, D / 2, 16, 2]`` (groups of 16 tokens,
    pairs of dimensions), values ``[D / 16, block_size / 2, 16, 2]`` (groups of 16
    dimensions, pairs of tokens). Block size and head size must be multiples of 32."""

    @classmethod
    def for_vllm_isa(cls, isa: str, dtype: torch.dtype) -> CpuKVPacking:
        """The packing vLLM's CPU attention kernel ``isa`` writes for ``dtype``.

        Raises:
            InvalidInputError: an ISA (or ISA and dtype) whose packing is not described
                here, such as ``neon`` with bf16 (vLLM's BFMMLA kernels pack their own way).
        """
        name = str(isa).lower()
        if name in _VLLM_TRANSPOSED_KEY_ISAS:
            return cls.KEYS_TRANSPOSED
        if name == "neon" and dtype in (torch.float32, torch.float16):
            return cls.KEYS_TRANSPOSED
        if name == "amx" and dtype == torch.bfloat16:
            return cls.AMX
        known = ", ".join(sorted({*_VLLM_TRANSPOSED_KEY_ISAS, "neon (fp32, fp16)", "amx (bf16)"}))
        raise InvalidInputError(
            f"isa: vLLM's CPU attention kernel {isa!r} with {dtype_name(dtype)} packs the KV "
            f"cache in a way lmcache_async does not describe; supported: {known}"
        )


def as_cpu_packing(value: object) -> CpuKVPacking:
    """``value`` as a :class:`CpuKVPacking` (a member, or its value).

    Raises:
        InvalidInputError: ``value`` names no packing.
    """
    if isinstance(value, CpuKVPacking):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return CpuKVPacking(value)
    choices = ", ".join(p.value for p in CpuKVPacking)
    raise InvalidInputError(f"cpu_packing: expected one of {choices}, got {value!r:.40}")


class PagedLayout(Protocol):
    """The fields and shapes of a layout that the checks and row helpers of this package
    read. :class:`~lmcache_async.layouts.KVLayout` is the layout; the helpers take it by
    this interface because that class delegates to them."""

    @property
    def kind(self) -> LayoutKind: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_size(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def hnd(self) -> bool: ...
    @property
    def cpu_packing(self) -> CpuKVPacking | None: ...
    @property
    def tp_world_size(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def width(self) -> int: ...
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]: ...
    def payload_shape(self, num_tokens: int) -> tuple[int, ...]: ...
