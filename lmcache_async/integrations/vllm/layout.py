"""How the connector reads vLLM's paged KV memory: which :class:`~lmcache_async.KVLayout`
(and for vLLM's CPU attention, which :class:`~lmcache_async.layouts.CpuKVPacking`) the
per-layer tensors vLLM registers are in, and in which order the layers run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts import CpuKVPacking, KVLayout
from lmcache_async.logging import get_logger

__all__ = ["detect_layout", "layer_order"]

log = get_logger(__name__)


def detect_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int,
    head_size: int,
    use_mla: bool = False,
    tp_world_size: int = 1,
    tp_rank: int = 0,
    cpu_isa: str | None = None,
) -> tuple[KVLayout, list[torch.Tensor]]:
    """Recognise the per-layer KV tensors vLLM registers and return their layout.

    Known layouts (``H`` = ``num_kv_heads`` of this rank, ``D`` = ``head_size``):

    * vLLM CPU attention: ``[num_blocks, H, block_size, 2 * D]``, contiguous, on the CPU,
      each block and head packed as the attention kernel ("ISA") vLLM picks for the dtype,
      block size and CPU wants (``cpu_isa``, asked from vLLM when not given). The packing
      is checked by writing one block with vLLM's own ``cpu_attn_reshape_and_cache`` and
      reading it back;
    * vLLM's GPU flash-attention (0.32): ``[num_blocks, H, block_size, 2 * D]`` on the
      device, each token's row its keys then its values (``CpuKVPacking.TOKEN_ROWS``);
    * flash-attention: ``[2, num_blocks, block_size, H, D]`` (NHD, or HND strides);
    * FlashInfer-style: ``[num_blocks, 2, block_size, H, D]``;
    * MLA (``use_mla``): ``[num_blocks, block_size, latent]`` or
      ``[num_blocks, 1, block_size, latent]`` (returned as 3-D views).

    Returns the layout and the tensors to hand to the engine (views of the same memory).

    Raises:
        InvalidInputError: no tensors, or a shape, stride, dtype or device that matches no
            known layout (the message names what was seen); or a vLLM CPU attention
            kernel whose packing lmcache_async does not describe, or that packs a block
            otherwise than the layout says.
    """
    tensors = list(kv_caches)
    if not tensors:
        raise InvalidInputError("no KV cache tensors were registered")
    first = tensors[0]
    shape = tuple(first.shape)
    seen = (
        f"per-layer tensor of shape {shape}, strides {first.stride()}, dtype "
        f"{str(first.dtype).removeprefix('torch.')} on {first.device} "
        f"(expected num_kv_heads={num_kv_heads}, head_size={head_size}, use_mla={use_mla})"
    )
    common: dict[str, Any] = {"dtype": first.dtype, "tp_world_size": tp_world_size}
    common["tp_rank"] = tp_rank
    layout: KVLayout | None = None
    if use_mla:
        if first.ndim == 4 and shape[1] == 1 and first.is_contiguous():
            tensors = [t.view(t.shape[0], t.shape[2], t.shape[3]) for t in tensors]
            shape = (shape[0], shape[2], shape[3])
        if len(shape) == 3:
            layout = KVLayout.mla(
                num_layers=len(tensors), block_size=shape[1], latent_dim=shape[2], **common
            )
    elif first.ndim == 5 and shape[3:] == (num_kv_heads, head_size):
        if shape[0] == 2:
            hnd = not first.is_contiguous() and first.transpose(2, 3).is_contiguous()
            layout = KVLayout.vllm_flash_attn(
                num_layers=len(tensors),
                block_size=shape[2],
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                hnd=hnd,
                **common,
            )
        elif shape[1] == 2:
            layout = KVLayout.flashinfer(
                num_layers=len(tensors),
                block_size=shape[2],
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                **common,
            )
    elif first.ndim == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size:
        if first.device.type != "cpu":
            # vLLM's GPU flash-attention backend: each token's row holds K then V.
            layout = KVLayout.vllm_cpu(
                num_layers=len(tensors),
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                block_size=shape[2],
                packing=CpuKVPacking.TOKEN_ROWS,
                **common,
            )
            layout.check_kv_caches(tensors)
            return layout, tensors
        isa = cpu_isa or _vllm_cpu_isa(first.dtype, shape[2], head_size)
        layout = KVLayout.vllm_cpu(
            num_layers=len(tensors),
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=shape[2],
            packing=CpuKVPacking.for_vllm_isa(isa, first.dtype),
            **common,
        )
        _check_cpu_packing(layout, isa)
    if layout is None:
        raise InvalidInputError(f"unknown KV cache layout: {seen}")
    layout.check_kv_caches(tensors)
    return layout, tensors


def _vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The attention kernel vLLM's CPU backend picks for a cache of this dtype and shape.

    Raises:
        InvalidInputError: this vLLM does not say (its CPU attention backend is missing or
            picks kernels another way).
    """
    try:
        # Only CPU caches need vLLM's CPU backend; other builds may lack or break it.
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

        return str(_get_attn_isa(dtype, block_size, head_size))
    except (ImportError, TypeError, NotImplementedError) as exc:
        raise InvalidInputError(
            f"cannot tell which attention kernel vLLM's CPU backend uses, so not how it packs "
            f"the KV cache ({type(exc).__name__}: {exc}); pass cpu_isa to detect_layout"
        ) from exc


def _check_cpu_packing(layout: KVLayout, isa: str) -> None:
    """Write one block through vLLM's ``cpu_attn_reshape_and_cache`` for ``isa`` and read it
    back through ``layout``, so a kernel that packs otherwise is refused, not misread.

    Skipped (with a warning) when vLLM's CPU ops cannot run here.

    Raises:
        InvalidInputError: the block read back differs from what vLLM was given.
    """
    probe = KVLayout.vllm_cpu(
        num_layers=1,
        num_kv_heads=layout.num_kv_heads,
        head_size=layout.head_size,
        dtype=layout.dtype,
        block_size=layout.block_size,
        packing=layout.cpu_packing or CpuKVPacking.KEYS_TRANSPOSED,
    )
    bs, heads, size = probe.block_size, probe.num_kv_heads, probe.head_size
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(bs, heads, size, generator=gen).to(probe.dtype)
    values = torch.randn(bs, heads, size, generator=gen).to(probe.dtype)
    cache = torch.zeros(probe.kv_cache_shape(1), dtype=probe.dtype)
    key_cache, value_cache = cache.view(1, heads, 2 * bs, size).chunk(2, dim=2)
    slots = torch.arange(bs - 1, -1, -1, dtype=torch.int64)
    try:
        from vllm import _custom_ops  # noqa: PLC0415  # loads vLLM's compiled ops: CPU only

        _custom_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    except (ImportError, AttributeError, RuntimeError) as exc:
        log.warning("vllm_cpu_packing_unchecked", isa=isa, error=str(exc))
        return
    out = torch.empty(probe.payload_shape(bs), dtype=probe.dtype)
    probe.gather([cache], slots, out)
    if not (
        torch.equal(out[0, 0], keys.view(bs, -1)) and torch.equal(out[1, 0], values.view(bs, -1))
    ):
        raise InvalidInputError(
            f"vLLM's CPU attention kernel {isa!r} packs the KV cache otherwise than the "
            f"{probe.cpu_packing} layout describes; lmcache_async cannot read this cache"
        )


def layer_order(names: Sequence[str]) -> list[int]:
    """The indices of ``names`` (vLLM's attention layer names) in the model's layer order.

    Each name is expected to hold one integer part, the layer number
    (``model.layers.3.self_attn.attn``); when every name does and no two share one, the
    names are ordered by it, so every process lays the layers out alike and layerwise
    transfers follow the forward pass. Otherwise the given order is kept.
    """
    numbers: list[int] = []
    for name in names:
        found = [int(part) for part in name.split(".") if part.isdigit()]
        if len(found) != 1:
            return list(range(len(names)))
        numbers.append(found[0])
    if len(set(numbers)) != len(numbers):
        return list(range(len(names)))
    return sorted(range(len(names)), key=numbers.__getitem__)
