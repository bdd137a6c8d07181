"""vLLM's CPU attention layout: where each token's keys and values lie in a layer packed
as its :class:`~lmcache_async.layouts.kinds.CpuKVPacking` says.

There a "row" is one token's values seen through a strided view of the flat layer whose
first dimension steps one element, so the row index of a token is the element offset where
its values start (:func:`cpu_parts`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts.checks import check_kv_caches
from lmcache_async.layouts.kinds import (
    CpuKVPacking,
    LayoutKind,
    PagedLayout,
    as_cpu_packing,
    dtype_name,
)
from lmcache_async.transfer.plan import PlanPart

__all__ = ["DEFAULT_VLLM_CPU_BLOCK_SIZE", "checked_cpu_packing", "cpu_parts"]

DEFAULT_VLLM_CPU_BLOCK_SIZE = 128
"""Block size vLLM's CPU attention backend uses unless told otherwise."""

AMX_KEY_TOKENS = 16
"""AMX key packing: tokens per group (a 64-byte tile row holds 16 four-byte words)."""
AMX_VALUE_DIMS = 16
"""AMX value packing: head dimensions per group."""
AMX_PAIR = 2
"""AMX packing: bf16 elements per four-byte word (two dims of a key, two tokens of a value)."""
AMX_ALIGNMENT = 32
"""AMX packing: block size and head size must be multiples of this (vLLM's kernel checks)."""


def checked_cpu_packing(
    kind: LayoutKind, packing: object, dtype: torch.dtype, block_size: int, head_size: int
) -> CpuKVPacking | None:
    """The ``cpu_packing`` a layout of ``kind`` holds for the one it was given: None for
    every kind but vLLM CPU, whose packing defaults to
    :attr:`~CpuKVPacking.KEYS_TRANSPOSED`.

    Raises:
        InvalidInputError: a packing for another kind, an unknown packing, or an AMX
            packing that the dtype or sizes do not fit.
    """
    if kind is not LayoutKind.VLLM_CPU:
        if packing is not None:
            raise InvalidInputError(
                f"cpu_packing: only meaningful for {LayoutKind.VLLM_CPU.value}, not {kind.value}"
            )
        return None
    packing = CpuKVPacking.KEYS_TRANSPOSED if packing is None else as_cpu_packing(packing)
    if packing is CpuKVPacking.AMX:
        if dtype != torch.bfloat16:
            raise InvalidInputError(
                f"cpu_packing: the amx packing holds bfloat16, got {dtype_name(dtype)}"
            )
        for name, size in (("block_size", block_size), ("head_size", head_size)):
            if size % AMX_ALIGNMENT:
                raise InvalidInputError(
                    f"{name}: the amx packing needs a multiple of {AMX_ALIGNMENT}, got {size}"
                )
    return packing


def cpu_parts(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, num_blocks: int
) -> list[PlanPart]:
    """K and V of vLLM's CPU layout as one row per token of strided views of each layer.

    Per block and head a layer holds ``block_size * D`` key elements, then as many
    value elements, packed as the layout's ``cpu_packing`` says. All of a token's K (or V)
    values sit at fixed strides from the element where its head-0 values start, so a
    view of the flat layer sized ``[rows, H, *dims]`` with strides ``[1, head_stride,
    *dim_strides]`` holds the token's values, in payload order, as row ``start``. The
    rows overlap; a transfer touches only the rows of distinct slots, whose elements
    are distinct.

    ``slots`` is int64 with no negative entries.

    Raises:
        InvalidInputError: a layer does not match the layout.
    """
    shape = torch.Size(layout.kv_cache_shape(num_blocks))
    flats: list[torch.Tensor] = []
    for layer in kv_caches:
        if layer.shape != shape or layer.dtype != layout.dtype or not layer.is_contiguous():
            check_kv_caches(layout, kv_caches)
        flats.append(layer.view(-1))
    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_size
    region = bs * d  # one head's keys (or values) in one block
    head_stride = 2 * region
    blocks = torch.div(slots, bs, rounding_mode="floor")
    offsets = slots - blocks * bs
    keys = blocks * (h * head_stride)
    values = keys + region
    specs: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]
    if layout.cpu_packing is CpuKVPacking.AMX:
        # Keys [bs/16, D/2, 16, 2]: token t in group t // 16, at word t % 16 of each
        # group row; a row holds one pair of dimensions of 16 tokens.
        tokens, pair = AMX_KEY_TOKENS, AMX_PAIR
        group = torch.div(offsets, tokens, rounding_mode="floor")
        keys = keys + group * (tokens * d) + (offsets - group * tokens) * pair
        # Values [D/16, bs/2, 16, 2]: a pair of tokens per 16 dimensions of a group.
        dims = AMX_VALUE_DIMS
        pairs = torch.div(offsets, pair, rounding_mode="floor")
        values = values + pairs * (dims * pair) + (offsets - pairs * pair)
        specs = [
            (keys, (h, d // pair, pair), (head_stride, tokens * pair, 1)),
            (values, (h, d // dims, dims), (head_stride, dims * bs, pair)),
        ]
    elif layout.cpu_packing is CpuKVPacking.TOKEN_ROWS:
        # [bs, 2D]: a token's row holds its keys, then its values.
        rows = keys + offsets * (2 * d)
        specs = [(rows, (h, d), (head_stride, 1)), (rows + d, (h, d), (head_stride, 1))]
    else:
        # Keys [D, bs] (a token is a column), values [bs, D] (a token is a row).
        specs = [
            (keys + offsets, (h, d), (head_stride, bs)),
            (values + offsets * d, (h, d), (head_stride, 1)),
        ]
    numel = num_blocks * h * head_stride
    parts: list[PlanPart] = []
    for index, dims_shape, strides in specs:
        extent = sum((n - 1) * stride for n, stride in zip(dims_shape, strides, strict=True))
        size, stride = (numel - extent, *dims_shape), (1, *strides)
        parts.append(PlanPart([f.as_strided(size, stride) for f in flats], index, dims_shape))
    return parts
