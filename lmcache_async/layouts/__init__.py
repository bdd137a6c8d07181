"""KV-cache memory layouts: how a serving engine's paged KV memory is shaped, and how chunks
move between it and a contiguous chunk payload.

A serving engine keeps, per attention layer, one tensor of fixed-size blocks. A token's
place in it is its *slot*, ``block_id * block_size + offset_in_block``; a negative slot
means "no place, skip this token". :class:`KVLayout` knows the engine's shape and memory
order and moves the tokens named by a slot mapping to and from a chunk payload:

* ``KV_2LTD`` payload ``[2, num_layers, tokens, num_kv_heads * head_size]`` (K = 0, V = 1);
* ``KV_MLA`` payload ``[1, num_layers, tokens, latent_dim]``.

Every transfer is one vectorised ``index_select`` / ``index_copy_`` per layer and payload
part on a *row view* of the layer (a view of the layer's own memory, no copy). The row
indices of K and V for all tokens are computed once per request from the slots, then reused
for every layer. For most layouts a row is a run of contiguous elements (``H * D``, or
``D`` of one head). vLLM's CPU attention packs each block and head in its own order
(:class:`CpuKVPacking`: keys transposed, or AMX tiles); there a "row" is one token's values
seen through a strided view of the flat layer whose first dimension steps one element, so
the row index of a token is the element offset where its values start.

The modules: :mod:`~lmcache_async.layouts.kinds` (element types, formats, kinds, CPU
packings), :mod:`~lmcache_async.layouts.layout` (:class:`KVLayout`),
:mod:`~lmcache_async.layouts.checks` (what callers hand a layout),
:mod:`~lmcache_async.layouts.rows` and :mod:`~lmcache_async.layouts.cpu_rows` (where
tokens lie, and transfer plans), :mod:`~lmcache_async.layouts.plain` (a layout as a dict)
and :mod:`~lmcache_async.layouts.views` (:class:`KVCacheViews`).

May import: the ground floor and the other data-model packages (``keys``, ``transfer``).
Never ``backends`` or anything above.
"""

from __future__ import annotations

from lmcache_async.layouts.cpu_rows import DEFAULT_VLLM_CPU_BLOCK_SIZE
from lmcache_async.layouts.kinds import SUPPORTED_DTYPES, CpuKVPacking, KVFormat, LayoutKind
from lmcache_async.layouts.layout import KVLayout
from lmcache_async.layouts.views import KVCacheViews
from lmcache_async.transfer.plan import TransferPlan

__all__ = [
    "DEFAULT_VLLM_CPU_BLOCK_SIZE",
    "SUPPORTED_DTYPES",
    "CpuKVPacking",
    "KVCacheViews",
    "KVFormat",
    "KVLayout",
    "LayoutKind",
    "TransferPlan",
]
