"""Row views and row indices: where each token's K and V lie in a layer of a paged layout,
and the transfer plans built from them.

Every transfer is one vectorised ``index_select`` / ``index_copy_`` per layer and payload
part on a *row view* of the layer (a view of the layer's own memory, no copy). The row
indices of K and V for all tokens are computed once per request from the slots, then reused
for every layer. For most layouts a row is a run of contiguous elements (``H * D``, or
``D`` of one head); vLLM's CPU layout has rows of its own
(:mod:`lmcache_async.layouts.cpu_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts.checks import (
    cache_geometry,
    check_kv_caches,
    check_payload,
    check_slots_tensor,
    slot_range,
)
from lmcache_async.layouts.cpu_rows import cpu_parts
from lmcache_async.layouts.kinds import LayoutKind, PagedLayout
from lmcache_async.transfer.plan import PlanPart, TransferPlan

__all__ = [
    "allocate_layers",
    "gather_tokens",
    "plan_parts",
    "plan_transfers",
    "row_indices",
    "row_views",
    "scatter_tokens",
]


def allocate_layers(
    layout: PagedLayout,
    num_blocks: int,
    device: str | torch.device,
    generator: torch.Generator | None,
    random: bool,
) -> list[torch.Tensor]:
    """:meth:`KVLayout.allocate_kv_caches
    <lmcache_async.layouts.KVLayout.allocate_kv_caches>` of ``layout``.

    Raises:
        InvalidInputError: ``num_blocks`` is not positive.
    """
    shape = layout.kv_cache_shape(num_blocks)
    if layout.hnd:
        # Memory ordered [2, nb, H, bs, D]; the caller sees [2, nb, bs, H, D].
        shape = (shape[0], shape[1], shape[3], shape[2], shape[4])
    layers: list[torch.Tensor] = []
    for _ in range(layout.num_layers):
        if random:
            t = torch.randn(shape, generator=generator, dtype=layout.dtype, device=device)
        else:
            t = torch.zeros(shape, dtype=layout.dtype, device=device)
        layers.append(t.transpose(2, 3) if layout.hnd else t)
    return layers


def row_views(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor], num_blocks: int
) -> list[torch.Tensor]:
    """Each layer as a 2-D ``[rows, row_width]`` view of its own memory (no copy).

    Every layer gets a cheap shape, dtype and memory-order check, so a bad layer fails
    here with a clear error rather than as an out-of-range index on the device.

    Not for the vLLM CPU layout (see :func:`~lmcache_async.layouts.cpu_rows.cpu_parts`).

    Raises:
        InvalidInputError: a layer does not match the layout.
    """
    shape = torch.Size(layout.kv_cache_shape(num_blocks))
    dtype = layout.dtype
    views: list[torch.Tensor] = []
    if layout.hnd:
        bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_size
        rows_shape = (2 * num_blocks * h * bs, d)
        # Strides of memory [2, nb, H, bs, D] seen as [2, nb, bs, H, D].
        strides = (num_blocks * h * bs * d, h * bs * d, d, bs * d, 1)
        for layer in kv_caches:
            if layer.shape != shape or layer.dtype != dtype:
                check_kv_caches(layout, kv_caches)
            if layer.stride() == strides:
                # as_strided skips the transpose and is bounds-checked against storage.
                views.append(layer.as_strided(rows_shape, (d, 1)))
                continue
            memory = layer.transpose(2, 3)
            if not memory.is_contiguous():
                check_kv_caches(layout, kv_caches)
            views.append(memory.view(rows_shape))
        return views
    for layer in kv_caches:
        if layer.shape != shape or layer.dtype != dtype or not layer.is_contiguous():
            check_kv_caches(layout, kv_caches)
        views.append(layer.view(-1, layout.width))
    return views


def row_indices(
    layout: PagedLayout, slots: torch.Tensor, num_blocks: int
) -> tuple[list[torch.Tensor], int]:
    """Row indices into the row views for each payload part (K, V or the MLA latent).

    ``slots`` is int64 with no negative entries. Returns the index tensors and the row
    width; for HND a token spans ``num_kv_heads`` rows of ``head_size``, listed
    token-major so they line up with a payload part viewed as rows. (vLLM CPU: see
    :func:`~lmcache_async.layouts.cpu_rows.cpu_parts`.)
    """
    bs = layout.block_size
    kind = layout.kind
    if kind is LayoutKind.MLA:
        return [slots], layout.width
    if kind is LayoutKind.VLLM_FLASH_ATTN and not layout.hnd:
        return [slots, slots + num_blocks * bs], layout.width
    blocks = torch.div(slots, bs, rounding_mode="floor")
    if kind is LayoutKind.FLASHINFER:
        # [nb, 2, bs] rows: block b's K rows start at 2*b*bs, its V rows bs later.
        rows_k = slots + blocks * bs
        return [rows_k, rows_k + bs], layout.width
    # HND: [2, nb, H, bs] rows of head_size.
    h = layout.num_kv_heads
    base = slots + blocks * (h * bs - bs)
    heads = torch.arange(0, h * bs, bs, device=slots.device)
    rows_k = (base.unsqueeze(1) + heads).view(-1)
    return [rows_k, rows_k + num_blocks * h * bs], layout.head_size


def plan_parts(
    layout: PagedLayout,
    kv_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    num_blocks: int,
    views: list[torch.Tensor] | None,
) -> list[PlanPart]:
    """Each payload part's row views and row indices, for a transfer plan.

    ``slots`` is int64 with no negative entries; ``views``: the caches' row views when the
    caller keeps them (made here when None; unused for the vLLM CPU layout).

    Raises:
        InvalidInputError: a layer does not match the layout.
    """
    if layout.kind is LayoutKind.VLLM_CPU:
        return cpu_parts(layout, kv_caches, slots, num_blocks)
    rows, width = row_indices(layout, slots, num_blocks)
    if views is None:
        views = row_views(layout, kv_caches, num_blocks)
    return [PlanPart(views, index, (width,)) for index in rows]


def plan_transfers(
    layout: PagedLayout,
    kv_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    slots_cpu: torch.Tensor | None,
    row_views: list[torch.Tensor] | None,
) -> TransferPlan:
    """:meth:`KVLayout.plan <lmcache_async.layouts.KVLayout.plan>` of ``layout``.

    Raises:
        InvalidInputError: a layer does not match the layout.
    """
    num_blocks, device = cache_geometry(layout, kv_caches)
    host = slots if slots_cpu is None else slots_cpu
    negative: list[int] = []
    if host.numel() and int(host.min()) < 0:
        negative = torch.nonzero(host < 0).view(-1).tolist()
    slots = slots.to(device=device, dtype=torch.int64, non_blocking=True)
    if negative:
        slots = slots.clamp(min=0)  # keeps the row arithmetic in range; never copied
    parts = plan_parts(layout, kv_caches, slots, num_blocks, row_views)
    return TransferPlan(
        layout,
        parts=parts,
        rows_per_token=parts[0].index.shape[0] // max(int(slots.shape[0]), 1),
        negative=negative,
        device=device,
    )


def gather_tokens(
    layout: PagedLayout, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor
) -> None:
    """:meth:`KVLayout.gather <lmcache_async.layouts.KVLayout.gather>` of ``layout``.

    Raises:
        InvalidInputError: a negative or out-of-range slot, or a malformed ``out``,
            ``slots`` or cache list.
    """
    num_blocks, _ = cache_geometry(layout, kv_caches)
    slots = check_slots_tensor(slots)
    num_tokens = int(slots.shape[0])
    out = check_payload(layout, "out", out, num_tokens)
    if not out.is_contiguous():
        raise InvalidInputError("out: must be contiguous")
    low = slot_range(slots, num_blocks * layout.block_size)
    if low < 0:
        raise InvalidInputError(
            f"slots: gather needs every slot >= 0, got {low}; drop skipped tokens first"
        )
    if num_tokens:
        plan_transfers(layout, kv_caches, slots, None, None).gather(0, num_tokens, out)


def scatter_tokens(
    layout: PagedLayout,
    payload: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
) -> None:
    """:meth:`KVLayout.scatter <lmcache_async.layouts.KVLayout.scatter>` of ``layout``.

    Raises:
        InvalidInputError: an out-of-range slot, or a malformed payload, ``slots`` or
            cache list.
    """
    num_blocks, _ = cache_geometry(layout, kv_caches)
    slots = check_slots_tensor(slots)
    num_tokens = int(slots.shape[0])
    payload = check_payload(layout, "payload", payload, num_tokens)
    slot_range(slots, num_blocks * layout.block_size)
    if num_tokens:
        plan_transfers(layout, kv_caches, slots, None, None).scatter(payload, 0, num_tokens)
