"""The checked KV caches of the last request and their row views, kept for the next one."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from lmcache_async.errors import InvalidInputError
from lmcache_async.layouts.kinds import LayoutKind
from lmcache_async.layouts.layout import KVLayout
from lmcache_async.layouts.rows import row_views
from lmcache_async.transfer.plan import TransferPlan

__all__ = ["KVCacheViews"]

_LayerSignature = tuple[int, torch.Size, tuple[int, ...], torch.dtype, torch.device]


def _signature(layer: torch.Tensor) -> _LayerSignature:
    """What a layer's row view depends on: memory address, shape, strides, dtype, device."""
    return (layer.data_ptr(), layer.shape, layer.stride(), layer.dtype, layer.device)


class KVCacheViews:
    """The checked KV caches of the last request, with their row views, for the next one.

    A serving engine passes the same per-layer tensors with every request, and checking
    each layer and viewing it as rows costs microseconds a layer, every request. A request
    over the very same tensor objects, each with the memory address, shape, strides, dtype
    and device it had when checked, reuses the check and the views; anything else is
    checked and viewed anew. Only weak references to the tensors are kept, and the views
    are dropped as soon as one of them is collected: this never keeps the serving
    engine's memory alive. For one event loop (or one thread) at a time.
    """

    __slots__ = ("__weakref__", "_layers", "_layout", "_num_blocks", "_signatures", "_views")

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self._layers: list[weakref.ref[torch.Tensor]] = []
        self._signatures: list[_LayerSignature] = []
        self._num_blocks = 0
        self._views: list[torch.Tensor] | None = None

    def check(self, kv_caches: Sequence[torch.Tensor]) -> tuple[int, list[torch.Tensor] | None]:
        """:meth:`KVLayout.check_kv_caches`, and the caches' row views for
        :meth:`KVLayout.plan` (None for the vLLM CPU layout, whose plan makes its own).

        Raises:
            InvalidInputError: as :meth:`KVLayout.check_kv_caches`.
        """
        layers = self._layers
        given: object = kv_caches
        if (
            layers
            and isinstance(given, (list, tuple))
            and len(kv_caches) == len(layers)
            and all(ref() is layer for ref, layer in zip(layers, kv_caches, strict=True))
            and list(map(_signature, kv_caches)) == self._signatures
        ):
            return self._num_blocks, self._views
        self.forget()
        layout = self._layout
        num_blocks = layout.check_kv_caches(kv_caches)
        views = None
        if layout.kind is not LayoutKind.VLLM_CPU:
            # Detached, a view no longer refers to the tensor it was made from (only to
            # its memory), so the weak references below can see the tensors go.
            views = [view.detach() for view in row_views(layout, kv_caches, num_blocks)]
        forget = weakref.WeakMethod(self.forget)

        def on_collected(_: weakref.ref[torch.Tensor]) -> None:
            method = forget()
            if method is not None:
                method()

        self._layers = [weakref.ref(layer, on_collected) for layer in kv_caches]
        self._signatures = list(map(_signature, kv_caches))
        self._num_blocks = num_blocks
        self._views = views
        return num_blocks, views

    def plan(
        self, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, num_tokens: int
    ) -> tuple[TransferPlan, torch.Tensor]:
        """One request's transfer plan over ``kv_caches`` (checked as :meth:`check` does)
        and its slot mapping on the CPU.

        Raises:
            InvalidInputError: ``kv_caches`` is not a list of tensors of this layout, or the
                slot mapping is not a 1-D int64 tensor of ``num_tokens`` slots in range.
        """
        given: object = kv_caches  # checked at run time: callers are not type-checked
        if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
            raise InvalidInputError("kv_caches must be a list of per-layer tensors")
        if not isinstance(slot_mapping, torch.Tensor):
            raise InvalidInputError("slot_mapping must be a 1-D integer tensor")
        num_blocks, row_views = self.check(kv_caches)
        layout = self._layout
        slots = layout.check_slot_mapping(slot_mapping, num_tokens, num_blocks)
        slots_cpu = slots if slots.device.type == "cpu" else slots.cpu()
        plan = layout.plan(kv_caches, slots, slots_cpu=slots_cpu, row_views=row_views)
        return plan, slots_cpu

    @property
    def remembered(self) -> bool:
        """Whether caches (and their views) are remembered for the next :meth:`check`."""
        return bool(self._layers)

    def forget(self) -> None:
        """Drop what is remembered (the next :meth:`check` checks in full)."""
        self._layers = []
        self._signatures = []
        self._views = None
