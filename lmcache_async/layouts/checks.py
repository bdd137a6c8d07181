"""Checks of what a caller hands a layout: its fields, the engine's per-layer KV tensors,
a slot mapping, a chunk payload. Each names the argument and what is
wrong with it.

:class:`~lmcache_async.layouts.KVLayout` delegates its checks here; they read the layout
through :class:`~lmcache_async.layouts.kinds.PagedLayout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import is_strict_int
from lmcache_async.layouts.kinds import (
    SUPPORTED_DTYPES,
    LayoutKind,
    PagedLayout,
    dtype_name,
    is_integer_dtype,
)

__all__ = [
    "FIELD_MAXIMA",
    "cache_geometry",
    "check_fields",
    "check_kv_caches",
    "check_payload",
    "check_slot_mapping",
    "check_slots_tensor",
    "num_blocks_of",
    "slot_range",
]


FIELD_MAXIMA: Final = {
    "num_layers": 4096,
    "block_size": 1 << 16,
    "num_kv_heads": 4096,
    "head_size": 1 << 16,
    "tp_world_size": 1 << 16,
}
"""The largest value of each field: far beyond any model, so only a bogus layout (as a
hostile HELLO may name) is refused, before it sizes anything."""


def check_fields(layout: PagedLayout) -> None:
    """Check a new layout's fields (its ``kind`` already a :class:`LayoutKind`) one by one,
    then their combinations; ``cpu_packing`` is checked apart
    (:func:`~lmcache_async.layouts.cpu_rows.checked_cpu_packing`).

    Raises:
        InvalidInputError: a field is out of range or the combination is impossible; the
            message starts with the field's name.
    """
    for name, largest in FIELD_MAXIMA.items():
        value = getattr(layout, name)
        if not is_strict_int(value) or not 0 < value <= largest:
            raise InvalidInputError(
                f"{name}: expected a positive int of at most {largest}, got {value!r:.40}"
            )
    if not is_strict_int(layout.tp_rank) or not 0 <= layout.tp_rank < layout.tp_world_size:
        raise InvalidInputError(
            f"tp_rank: expected an int in [0, {layout.tp_world_size}), got {layout.tp_rank!r}"
        )
    if layout.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise InvalidInputError(f"dtype: expected one of {names}, got {layout.dtype!r}")
    hnd: object = layout.hnd
    if not isinstance(hnd, bool):
        raise InvalidInputError(f"hnd: expected a bool, got {hnd!r}")
    if layout.hnd and layout.kind is not LayoutKind.VLLM_FLASH_ATTN:
        raise InvalidInputError(
            f"hnd: only meaningful for {LayoutKind.VLLM_FLASH_ATTN.value}, not {layout.kind.value}"
        )
    if layout.kind is LayoutKind.MLA and layout.num_kv_heads != 1:
        raise InvalidInputError(
            f"num_kv_heads: must be 1 for the mla layout, got {layout.num_kv_heads}"
        )


def num_blocks_of(layout: PagedLayout, layer: torch.Tensor) -> int:
    """The number of blocks of one layer tensor in ``layout``'s logical shape."""
    return int(layer.shape[1] if layout.kind is LayoutKind.VLLM_FLASH_ATTN else layer.shape[0])


def _has_memory_order(layout: PagedLayout, layer: torch.Tensor) -> bool:
    if layout.hnd:
        return layer.transpose(2, 3).is_contiguous()
    return layer.is_contiguous()


def _memory_order_text(layout: PagedLayout) -> str:
    if layout.hnd:
        return "[2, num_blocks, num_kv_heads, block_size, head_size] (HND)"
    if layout.kind is LayoutKind.VLLM_CPU:
        return "contiguous [num_blocks, num_kv_heads, block_size, 2 * head_size]"
    return "contiguous"


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.ndim}-D tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def check_kv_caches(layout: PagedLayout, kv_caches: Sequence[torch.Tensor]) -> int:
    """:meth:`KVLayout.check_kv_caches <lmcache_async.layouts.KVLayout.check_kv_caches>`:
    the number of blocks per layer of caches that fit ``layout``.

    Raises:
        InvalidInputError: naming the layer and what is wrong with it.
    """
    given: object = kv_caches
    if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
        raise InvalidInputError(
            f"kv_caches: expected a sequence of {layout.num_layers} layer tensors, "
            f"got {type(given).__name__}"
        )
    if len(kv_caches) != layout.num_layers:
        raise InvalidInputError(
            f"kv_caches: expected {layout.num_layers} layer tensors, got {len(kv_caches)}"
        )
    expected_ndim = len(layout.kv_cache_shape(1))
    first = kv_caches[0]
    if not isinstance(first, torch.Tensor) or first.ndim != expected_ndim:
        raise InvalidInputError(
            f"kv_caches[0]: expected a {expected_ndim}-D tensor, "
            f"got {_describe(first)} for the {layout.kind.value} layout"
        )
    num_blocks = num_blocks_of(layout, first)
    if num_blocks <= 0:
        raise InvalidInputError("kv_caches[0]: has no blocks (num_blocks is 0)")
    shape = torch.Size(layout.kv_cache_shape(num_blocks))
    device = first.device
    for i, layer in enumerate(kv_caches):
        if not isinstance(layer, torch.Tensor):
            raise InvalidInputError(f"kv_caches[{i}]: expected a tensor, got {_describe(layer)}")
        if layer.shape != shape:
            raise InvalidInputError(
                f"kv_caches[{i}]: expected shape {tuple(shape)}, got {tuple(layer.shape)}"
            )
        if layer.dtype != layout.dtype:
            raise InvalidInputError(
                f"kv_caches[{i}]: expected dtype {dtype_name(layout.dtype)}, "
                f"got {dtype_name(layer.dtype)}"
            )
        if layer.device != device:
            raise InvalidInputError(
                f"kv_caches[{i}]: on device {layer.device}, but kv_caches[0] is on {device}"
            )
        if not _has_memory_order(layout, layer):
            raise InvalidInputError(
                f"kv_caches[{i}]: expected memory ordered {_memory_order_text(layout)}, "
                f"got strides {layer.stride()}"
            )
    return num_blocks


def cache_geometry(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor]
) -> tuple[int, torch.device]:
    """The caches' blocks per layer and device, read from the first layer after the cheap
    checks (the layer count and the first layer's rank); the per-layer checks are left to
    the row views.

    Raises:
        InvalidInputError: as :func:`check_kv_caches`, when those cheap checks fail.
    """
    if len(kv_caches) != layout.num_layers:
        raise InvalidInputError(
            f"kv_caches: expected {layout.num_layers} layer tensors, got {len(kv_caches)}"
        )
    first = kv_caches[0]
    if not isinstance(first, torch.Tensor) or first.ndim != len(layout.kv_cache_shape(1)):
        check_kv_caches(layout, kv_caches)  # raises, naming what is wrong
    return num_blocks_of(layout, first), first.device


def check_slots_tensor(slot_mapping: object) -> torch.Tensor:
    """``slot_mapping`` if it is a 1-D integer tensor.

    Raises:
        InvalidInputError: it is not a tensor, not 1-D, or not of an integer dtype.
    """
    if not isinstance(slot_mapping, torch.Tensor):
        raise InvalidInputError(
            f"slot_mapping: expected a tensor, got {type(slot_mapping).__name__}"
        )
    if slot_mapping.ndim != 1:
        raise InvalidInputError(
            f"slot_mapping: expected a 1-D tensor, got shape {tuple(slot_mapping.shape)}"
        )
    if not is_integer_dtype(slot_mapping.dtype):
        raise InvalidInputError(
            f"slot_mapping: expected an integer dtype, got {dtype_name(slot_mapping.dtype)}"
        )
    return slot_mapping


def slot_range(slots: torch.Tensor, num_slots: int) -> int:
    """Check every slot is ``< num_slots`` and return the smallest (0 when empty).

    One reduction: a host synchronisation when ``slots`` lives on an accelerator.

    Raises:
        InvalidInputError: a slot is ``>= num_slots``.
    """
    if slots.numel() == 0:
        return 0
    low, high = (int(v) for v in torch.aminmax(slots))
    if high >= num_slots:
        raise InvalidInputError(
            f"slot_mapping: slot {high} out of range, the caches hold {num_slots} slots"
        )
    return low


def check_slot_mapping(
    block_size: int,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    num_blocks: int,
    device: str | torch.device | None,
) -> torch.Tensor:
    """:meth:`KVLayout.check_slot_mapping
    <lmcache_async.layouts.KVLayout.check_slot_mapping>` for blocks of ``block_size``.

    Raises:
        InvalidInputError: wrong type, rank, dtype, length, or a slot out of range.
    """
    if not is_strict_int(num_tokens) or num_tokens < 0:
        raise InvalidInputError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
    if not is_strict_int(num_blocks) or num_blocks <= 0:
        raise InvalidInputError(f"num_blocks: expected a positive int, got {num_blocks!r}")
    slots = check_slots_tensor(slot_mapping)
    if slots.shape[0] != num_tokens:
        raise InvalidInputError(
            f"slot_mapping: expected {num_tokens} entries, got {slots.shape[0]}"
        )
    slot_range(slots, num_blocks * block_size)
    return slots.to(device=slots.device if device is None else device, dtype=torch.int64)


def check_payload(layout: PagedLayout, name: str, payload: object, num_tokens: int) -> torch.Tensor:
    """``payload`` if it is a tensor of ``layout``'s payload shape for ``num_tokens`` tokens
    and of its dtype.

    Raises:
        InvalidInputError: naming ``name`` and what is wrong.
    """
    if not isinstance(payload, torch.Tensor):
        raise InvalidInputError(f"{name}: expected a tensor, got {type(payload).__name__}")
    expected = layout.payload_shape(num_tokens)
    if tuple(payload.shape) != expected:
        raise InvalidInputError(
            f"{name}: expected shape {expected} for {num_tokens} slots, got {tuple(payload.shape)}"
        )
    if payload.dtype != layout.dtype:
        raise InvalidInputError(
            f"{name}: expected dtype {dtype_name(layout.dtype)}, got {dtype_name(payload.dtype)}"
        )
    return payload
