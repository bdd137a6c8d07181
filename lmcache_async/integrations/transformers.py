"""Helpers for HuggingFace ``transformers``: keep a prompt prefix's KV in lmcache_async and
continue prefill from it.

A ``DynamicCache`` holds, per attention layer, keys and values of shape
``[batch=1, num_kv_heads, seq, head_dim]``. The cache engine works on a serving engine's
paged KV memory instead, so these helpers copy between the two through a small paged
buffer in the vLLM flash-attention layout (HND memory order, ``[2, blocks, heads, block,
head_dim]``, which keeps each head's rows of a block together as a ``DynamicCache`` does)
with the slot mapping ``0, 1, 2, ...``. Payload bytes do not depend on the block size or
memory order, so chunks stored here are the same bytes a vLLM worker with the same model
shape and dtype would store.

Typical use, with an embedded :class:`~lmcache_async.CacheEngine` or a
:class:`~lmcache_async.RemoteCacheEngine` (the helpers take any
:class:`~lmcache_async.KVCacheClient`)::

    layout = kv_layout_for(model.config, torch.float32)
    async with CacheEngine.open(config, layout, model_name="my-model") as engine:
        result = await prefill(model, input_ids, engine, layout)
        result.logits              # [1, T - result.reused_tokens, vocab]
        result.reused_tokens       # prefix tokens loaded instead of computed

Only models whose every layer uses full attention are supported (a sliding-window layer
keeps a truncated cache that a prefix cannot be rebuilt from).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio.to_thread
import torch
from transformers import DynamicCache

from lmcache_async.engine.client import KVCacheClient
from lmcache_async.errors import InvalidInputError
from lmcache_async.keys.tokens import Tokens
from lmcache_async.layouts import KVLayout, LayoutKind
from lmcache_async.logging import get_logger

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "PrefillResult",
    "dynamic_cache_to_paged",
    "kv_layout_for",
    "paged_to_dynamic_cache",
    "prefill",
    "retrieve_dynamic_cache",
    "store_dynamic_cache",
]

log = get_logger(__name__)

DEFAULT_BLOCK_SIZE: Final = 16
"""Tokens per block of the paged buffer the helpers copy through."""


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What :func:`prefill` computed.

    ``logits``: float ``[1, T - reused_tokens, vocab]``, the logits of the tokens the model
    ran on (the last row predicts the first new token). ``past_key_values``: the
    ``DynamicCache`` of the whole prompt, ready for decoding. ``reused_tokens``: prefix
    tokens whose KV came from the cache. ``stored_tokens``: what the store after the
    prefill reported (0 when not storing).
    """

    logits: torch.Tensor
    past_key_values: DynamicCache
    reused_tokens: int
    stored_tokens: int


def _config_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def kv_layout_for(
    model_config: Any, dtype: torch.dtype, *, block_size: int = DEFAULT_BLOCK_SIZE
) -> KVLayout:
    """The :class:`~lmcache_async.KVLayout` of a model's KV cache for these helpers.

    ``model_config`` is a transformers ``PretrainedConfig`` of a decoder (its text config
    is used for multimodal models): ``num_hidden_layers``, ``num_key_value_heads`` (else
    ``num_attention_heads``) and ``head_dim`` (else ``hidden_size // num_attention_heads``)
    give the shape; ``dtype`` is the model's (and so the KV cache's) element type.

    Raises:
        InvalidInputError: the config lacks one of those sizes, a layer is not full
            attention (sliding window, linear attention), or the dtype or block size is
            not one a layout takes.
    """
    get_text = getattr(model_config, "get_text_config", None)
    config = get_text(decoder=True) if callable(get_text) else model_config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        others = sorted({str(kind) for kind in layer_types} - {"full_attention"})
        if others:
            raise InvalidInputError(
                f"model_config: only full-attention layers can reuse a prefix, got {others}"
            )
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise InvalidInputError("model_config: sliding-window attention cannot reuse a prefix")
    num_layers = _config_int(config, "num_hidden_layers")
    num_heads = _config_int(config, "num_attention_heads")
    num_kv_heads = _config_int(config, "num_key_value_heads") or num_heads
    head_dim = _config_int(config, "head_dim")
    hidden = _config_int(config, "hidden_size")
    if head_dim is None and hidden is not None and num_heads:
        head_dim = hidden // num_heads
    if num_layers is None or num_kv_heads is None or head_dim is None:
        raise InvalidInputError(
            "model_config: needs num_hidden_layers, num_key_value_heads or "
            "num_attention_heads, and head_dim or hidden_size"
        )
    return KVLayout.vllm_flash_attn(
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_dim,
        dtype=dtype,
        hnd=True,
    )


def _check_layout(layout: KVLayout) -> None:
    if not isinstance(layout, KVLayout) or layout.kind is not LayoutKind.VLLM_FLASH_ATTN:
        raise InvalidInputError(
            "layout: the transformers helpers copy through a vllm_flash_attn layout "
            "(use kv_layout_for)"
        )


def _layer_tensors(
    cache: DynamicCache, layout: KVLayout
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)``, checked against ``layout``.

    Raises:
        InvalidInputError: wrong number of layers, a layer is empty or not
            ``[1, num_kv_heads, seq, head_size]`` of the layout's dtype, or the layers
            hold different lengths.
    """
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, Sequence):
        raise InvalidInputError(f"cache: expected a DynamicCache, got {type(cache).__name__}")
    if len(layers) != layout.num_layers:
        raise InvalidInputError(f"cache: {len(layers)} layers, the layout has {layout.num_layers}")
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    expected = (1, layout.num_kv_heads, layout.head_size)
    seq: int | None = None
    for index, layer in enumerate(layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise InvalidInputError(f"cache: layer {index} holds no keys and values")
        for name, t in (("keys", keys), ("values", values)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                raise InvalidInputError(
                    f"cache: layer {index} {name} have shape {tuple(t.shape)}, expected "
                    f"[1, {layout.num_kv_heads}, seq, {layout.head_size}] (batch size 1)"
                )
            if t.dtype != layout.dtype:
                raise InvalidInputError(
                    f"cache: layer {index} {name} are {t.dtype}, the layout is {layout.dtype}"
                )
        if values.shape[2] != keys.shape[2] or (seq is not None and keys.shape[2] != seq):
            raise InvalidInputError("cache: layers hold different numbers of tokens")
        seq = int(keys.shape[2])
        out.append((keys, values))
    return out


def dynamic_cache_to_paged(
    cache: DynamicCache, layout: KVLayout, num_tokens: int | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Copy the KV of the first ``num_tokens`` tokens (default: all) of ``cache`` into a
    fresh paged buffer in ``layout``.

    Returns ``(kv_caches, slot_mapping)``: one tensor per layer of logical shape
    ``layout.kv_cache_shape(ceil(num_tokens / block_size))`` and an int64 ``[num_tokens]``
    slot mapping ``0 .. num_tokens - 1``, ready for ``engine.store``.

    Raises:
        InvalidInputError: the cache does not fit the layout, or holds fewer than
            ``num_tokens`` tokens.
    """
    _check_layout(layout)
    layers = _layer_tensors(cache, layout)
    held = int(layers[0][0].shape[2])
    n = held if num_tokens is None else num_tokens
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= held:
        raise InvalidInputError(f"num_tokens: expected an int in [1, {held}], got {num_tokens!r}")
    block = layout.block_size
    num_blocks = math.ceil(n / block)
    full, rest = divmod(n, block)
    kv_caches = layout.allocate_kv_caches(num_blocks, device=layers[0][0].device, random=False)
    for paged, (keys, values) in zip(kv_caches, layers, strict=True):
        for part, source in ((0, keys), (1, values)):
            # [1, H, S, D] -> [S, H, D], written block by block into [blocks, block, H, D].
            rows = source[0, :, :n].transpose(0, 1)
            if full:
                paged[part, :full].copy_(rows[: full * block].view(full, block, *rows.shape[1:]))
            if rest:
                paged[part, full, :rest].copy_(rows[full * block :])
    return kv_caches, torch.arange(n, dtype=torch.int64)


def paged_to_dynamic_cache(
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    num_tokens: int,
    *,
    model_config: Any = None,
) -> DynamicCache:
    """A ``DynamicCache`` holding the KV of slots ``0 .. num_tokens - 1`` of ``kv_caches``
    (per layer ``[1, num_kv_heads, num_tokens, head_size]``, copied).

    ``model_config``, when given, lets transformers pick the cache layer types.

    Raises:
        InvalidInputError: the tensors do not fit the layout or hold fewer slots.
    """
    _check_layout(layout)
    num_blocks = layout.check_kv_caches(kv_caches)
    if not isinstance(num_tokens, int) or not 0 < num_tokens <= num_blocks * layout.block_size:
        raise InvalidInputError(
            f"num_tokens: expected an int in [1, {num_blocks * layout.block_size}], "
            f"got {num_tokens!r}"
        )
    shape = (num_blocks * layout.block_size, layout.num_kv_heads, layout.head_size)
    data: list[tuple[torch.Tensor, torch.Tensor]] = []
    for paged in kv_caches:
        keys, values = (
            paged[part].reshape(shape)[:num_tokens].transpose(0, 1).unsqueeze(0).contiguous()
            for part in (0, 1)
        )
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data, config=model_config)


def _token_count(tokens: Tokens) -> int:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise InvalidInputError(
                f"tokens: expected a 1-D tensor, got shape {tuple(tokens.shape)}"
            )
        return int(tokens.numel())
    return len(tokens)


async def store_dynamic_cache(
    engine: KVCacheClient,
    tokens: Tokens,
    cache: DynamicCache,
    layout: KVLayout,
    *,
    req_id: str | None = None,
) -> int:
    """Store the KV ``cache`` holds for ``tokens`` (the cache may hold more tokens, e.g.
    after decoding; only the first ``len(tokens)`` are stored).

    Returns what ``engine.store`` returns: tokens cached from the first stored chunk on
    (chunks already cached are skipped by the engine).

    Raises:
        InvalidInputError: the cache does not fit the layout or holds fewer tokens, or the
            tokens are invalid.
    """
    n = _token_count(tokens)
    if n == 0:
        return 0
    kv_caches, slots = await anyio.to_thread.run_sync(dynamic_cache_to_paged, cache, layout, n)
    return await engine.store(tokens, kv_caches=kv_caches, slot_mapping=slots, req_id=req_id)


async def retrieve_dynamic_cache(
    engine: KVCacheClient,
    tokens: Tokens,
    layout: KVLayout,
    *,
    max_tokens: int | None = None,
    model_config: Any = None,
    device: torch.device | str = "cpu",
    req_id: str | None = None,
) -> tuple[DynamicCache | None, int]:
    """Load the cached KV of the longest cached prefix of ``tokens`` into a new
    ``DynamicCache``.

    Returns ``(cache, n)``: ``n`` prefix tokens (at most ``max_tokens``) whose KV the cache
    holds (tensors on ``device``), or ``(None, 0)`` on a miss. The lookup pins the hit until
    the retrieve, so it cannot be evicted in between; a retrieve that loads less than the
    lookup promised (a chunk evicted or failing its checksum) gives the shorter prefix.

    Raises:
        InvalidInputError: invalid tokens, layout or ``max_tokens``.
    """
    _check_layout(layout)
    num_tokens = _token_count(tokens)
    limit = num_tokens if max_tokens is None else max_tokens
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise InvalidInputError(f"max_tokens: expected an int >= 0, got {max_tokens!r}")
    if num_tokens == 0 or limit == 0:
        return None, 0
    lookup_id = f"hf-{req_id}" if req_id is not None else f"hf-{secrets.token_hex(8)}"
    try:
        hit = await engine.lookup(tokens, lookup_id=lookup_id, pin=True)
        if hit <= 0:
            await engine.lookup_unpin(lookup_id)
            return None, 0
        # Retrieve exactly the chunks the lookup found (cutting inside a chunk changes its
        # key).
        prefix = tokens[:hit]
        num_blocks = math.ceil(hit / layout.block_size)
        kv_caches = layout.allocate_kv_caches(num_blocks, device=device, random=False)
        slots = torch.arange(hit, dtype=torch.int64)
        mask = await engine.retrieve(
            prefix, kv_caches=kv_caches, slot_mapping=slots, req_id=req_id, lookup_id=lookup_id
        )
    except BaseException:
        # Cancelled (or failed) between the lookup and its retrieve: the pins go now, not
        # at pin_timeout.
        with anyio.CancelScope(shield=True):
            await engine.lookup_unpin(lookup_id)
        raise
    missing = (~mask).nonzero()
    loaded = int(missing[0, 0]) if missing.numel() else int(mask.numel())
    if loaded < hit:
        log.info("hf_retrieve_short", req_id=req_id, hit_tokens=hit, loaded_tokens=loaded)
    use = min(loaded, limit)
    if use == 0:
        return None, 0
    cache = await anyio.to_thread.run_sync(
        lambda: paged_to_dynamic_cache(kv_caches, layout, use, model_config=model_config)
    )
    return cache, use


def _forward(model: Any, input_ids: torch.Tensor, cache: DynamicCache) -> Any:
    # inference_mode is thread-local: enter it in the thread that runs the model.
    with torch.inference_mode():
        return model(input_ids=input_ids, past_key_values=cache, use_cache=True)


async def prefill(
    model: Any,
    input_ids: torch.Tensor,
    engine: KVCacheClient,
    layout: KVLayout,
    *,
    store: bool = True,
    req_id: str | None = None,
) -> PrefillResult:
    """Prefill ``input_ids`` with ``model``, loading the cached prefix instead of
    computing it, and (with ``store``) store the prompt's KV afterwards.

    ``input_ids``: int64 ``[T]`` or ``[1, T]``. At most ``T - 1`` tokens are reused, so the
    model always runs on at least the last token and returns its logits. The forward pass
    runs in a worker thread under ``torch.inference_mode``, so the event loop stays free.

    Raises:
        InvalidInputError: ``input_ids`` is not one non-empty sequence of token ids, or the
            model's KV cache does not fit ``layout``.
    """
    ids = input_ids
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
        raise InvalidInputError("input_ids: expected an int64 tensor [T] or [1, T] with T > 0")
    tokens = ids.to("cpu", torch.int64)
    num_tokens = int(tokens.numel())
    config = getattr(model, "config", None)
    cache, reused = await retrieve_dynamic_cache(
        engine,
        tokens,
        layout,
        max_tokens=num_tokens - 1,
        model_config=config,
        device=ids.device,
        req_id=req_id,
    )
    if cache is None:
        cache = DynamicCache(config=config)
    rest = ids[reused:].unsqueeze(0)
    out = await anyio.to_thread.run_sync(_forward, model, rest, cache)
    past: DynamicCache = out.past_key_values
    stored = 0
    if store:
        stored = await store_dynamic_cache(engine, tokens, past, layout, req_id=req_id)
    return PrefillResult(
        logits=out.logits, past_key_values=past, reused_tokens=reused, stored_tokens=stored
    )
